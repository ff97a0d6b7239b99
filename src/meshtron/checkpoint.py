"""Orbax checkpoints of a training run: what is saved, integrity checks, restore onto any mesh.

One checkpoint is one orbax step directory (``ocp.CheckpointManager``), committed atomically: a
save killed half-way leaves only a temporary directory that is never listed as a step. It holds
three items:

* ``state``: ``{"params", "opt_state"}`` in the *canonical* layout -- block layers in model order
  (not the pipeline's stage order), each array a global array whatever mesh wrote it;
* ``errors`` (optional): 1-bit LAMB's per-device error-feedback buffers, which only mean something
  on the mesh layout that wrote them;
* ``meta`` (JSON): the run position (steps done, optimizer updates applied, next batch, and a streamed data
  source's read position at that batch), the seed,
  the whole config, the mesh layout, and a checksum of every saved tensor.

Restoring onto another mesh needs no conversion step: the targets are ``jax.ShapeDtypeStruct`` s
carrying the *current* run's shardings, so orbax reads for every device exactly its slice.

Damage is caught two ways: orbax/tensorstore fail to decode a truncated or garbled file, and a
checksum mismatch catches bytes that still decode. Either way that checkpoint is skipped with a
message and the one before it is used. A checkpoint of a *different model* is not damage: it is
refused with a message naming the first tensor that does not match.

Rotation (``checkpoint.keep``) removes only checkpoints the current run wrote. Every saved step
records its run's id (``meta["run"]``), which a resumed run adopts; steps of another run, imports
(which record none) and anything else in the directory are never deleted.
"""

from __future__ import annotations

import functools
import logging
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.checkpoint_dirs import TRACKER_RUNS, read_step_meta, step_directories
from meshtron.errors import CheckpointError
from meshtron.outputs import first_missing, remove_if_empty
from meshtron.trees import leaf_names

__all__ = ["CheckpointError", "CheckpointStore", "Restored", "RunPosition", "abstract_like", "checksums"]

FORMAT_VERSION = 1
_KNUTH = np.uint32(2654435761)  # odd multiplier: position-dependent weights make swapped values visible

# Orbax logs every save and restore at INFO/WARNING; the trainer says what matters itself.
for _name in ("absl", "orbax"):
    logging.getLogger(_name).setLevel(logging.ERROR)


@dataclass(frozen=True)
class RunPosition:
    """Where a run stands after ``step`` training steps."""

    step: int  # training steps done (= batches consumed)
    updates: int  # optimizer updates applied (steps minus skipped non-finite steps)
    data_position: int  # index of the next training batch
    data_cursor: dict[str, Any] | None = None  # a streamed source's read position at that batch (JSON)


@dataclass
class Restored:
    """A checkpoint read back onto the current mesh."""

    step: int
    position: RunPosition
    state: Any  # {"params", "opt_state"}, canonical layout, error buffers removed
    errors: list[dict[str, Any]] | None  # 1-bit LAMB buffers, or None when they were not restored
    meta: dict[str, Any]


def _fingerprint(x: jax.Array) -> jax.Array:
    """A uint32 checksum of ``x``'s bits, the same whatever the sharding (integer sums are exact)."""
    width = x.dtype.itemsize * 8
    if width not in (8, 16, 32):
        raise TypeError(f"checksum: unsupported dtype {x.dtype}")
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}")).astype(jnp.uint32)
    weights = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * _KNUTH + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


def _all_finite(tree: Any) -> jax.Array:
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def checksums(tree: Any, mesh) -> tuple[dict[str, int], bool]:
    """Per-leaf checksums of ``tree`` (keyed by :func:`leaf_names`) and whether every float is finite.

    Computed on the devices (nothing is gathered but one scalar per tensor), replicated so that
    every process gets them.
    """
    leaves = jax.tree.leaves(tree)
    with jax.set_mesh(mesh):
        sums, finite = _checksum_program(mesh, len(leaves))(leaves)
    return {name: int(s) for name, s in zip(leaf_names(tree), sums, strict=True)}, bool(finite)


@functools.cache
def _checksum_program(mesh, count: int):
    """One jitted program per mesh and leaf count, so a run's saves compile it once. Leaves held in host
    memory (``train.offload_optimizer``) are read onto the device first: a program computes in one memory."""
    replicated = NamedSharding(mesh, P())

    def program(xs):
        xs = [jax.device_put(x, jax.memory.Space.Device) for x in xs]
        return [_fingerprint(x) for x in xs], _all_finite(xs)

    return jax.jit(program, out_shardings=([replicated] * count, replicated))


def _saved_shapes(tree_metadata: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{dotted name: (shape, dtype)}`` of what orbax says an item holds."""
    tree = getattr(tree_metadata, "tree", tree_metadata)
    if tree is None:
        raise ValueError("the state item has no readable metadata")
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
        for path, leaf in flat if leaf is not None
    }


def check_compatible(saved: dict[str, tuple[tuple[int, ...], str]], target: Any, where: str,
                     resizable: frozenset[str] = frozenset(), partial: bool = False,
                     source: str = "checkpoint.dir") -> None:
    """Refuse a checkpoint whose tensors differ from the run's, naming the first one that does.

    Tensors named in ``resizable`` may differ in their leading dimension only (the vocabulary
    padding, which depends on the tensor-parallel size). With ``partial``, saved tensors the
    target does not ask for are fine. ``source`` is the setting that named the checkpoint (the fix
    suggests another one).
    """
    wanted = {name: (tuple(x.shape), str(np.dtype(x.dtype)))
              for name, x in zip(leaf_names(target), jax.tree.leaves(target), strict=True)}
    # Parameters first: "the model differs" is the message users need, not which moment differs.
    for name, (shape, dtype) in sorted(wanted.items(), key=lambda item: not item[0].startswith("params.")):
        if name not in saved:
            raise CheckpointError(
                f"{where} has no tensor {name} (shape {shape}): it was written by a different model or optimizer; "
                f"use the config it was trained with (its meta item records it) or another {source}"
            )
        have_shape, have_dtype = saved[name]
        same = have_shape == shape or (name in resizable and have_shape[1:] == shape[1:])
        if not same or have_dtype != dtype:
            raise CheckpointError(
                f"{where}: tensor {name} is {have_dtype}{list(have_shape)} in the checkpoint but this run's model "
                f"needs {dtype}{list(shape)}; use the model config it was trained with or another {source}"
            )
    extra = sorted(set(saved) - set(wanted))
    if extra and not partial:
        raise CheckpointError(
            f"{where} holds tensor {extra[0]} that this run does not have ({len(extra)} in all): it was written by a "
            f"different model or optimizer; use the config it was trained with or another {source}"
        )


def _as_saved(target: Any, saved: dict[str, tuple[tuple[int, ...], str]], mesh) -> Any:
    """``target`` with every leaf whose saved shape differs replaced by the saved shape, replicated
    (it is resized on the devices after reading: :func:`_resize_to`)."""
    replicated = NamedSharding(mesh, P())
    names = leaf_names(target)

    def read_as(name: str, t: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        shape = saved[name][0]
        return t if shape == t.shape else jax.ShapeDtypeStruct(shape, t.dtype, sharding=replicated)

    leaves = [read_as(n, t) for n, t in zip(names, jax.tree.leaves(target), strict=True)]
    return jax.tree.structure(target).unflatten(leaves)


def _restore_args(target: Any, partial: bool) -> ocp.args.PyTreeRestore:
    return ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=partial
    )


def _resize_to(tree: Any, target: Any, mesh) -> Any:
    """Pad with zeros (or cut) the leading dimension of leaves read at another size, onto ``target``."""

    def fit(x: jax.Array, t: jax.ShapeDtypeStruct) -> jax.Array:
        if x.shape == t.shape:
            return x
        rows = t.shape[0]
        x = x[:rows] if x.shape[0] >= rows else jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
        return x

    shardings = jax.tree.map(lambda t: t.sharding, target)
    with jax.set_mesh(mesh):
        return jax.jit(lambda xs: jax.tree.map(fit, xs, target), out_shardings=shardings)(tree)


def abstract_like(tree: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct`` targets with the given shardings: what orbax restores onto."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _warn(message: str) -> None:
    if jax.process_index() == 0:
        print(f"meshtron: {message}", file=sys.stderr)


class _KeepNewestOfThisRun:
    """Orbax's preservation policy for a run: of the steps this run wrote (its id in their meta, or
    saved by this store), the newest ``keep``; every other step in the directory, always."""

    def __init__(self, store: CheckpointStore, keep: int):
        self.store, self.keep = store, keep

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        owned = [i for i, info in enumerate(checkpoints) if self.store.owns(info.step)]
        dropped = set(owned[: max(0, len(owned) - self.keep)])
        return [i not in dropped for i in range(len(checkpoints))]


# Failures of the program or the machine while reading, not of the files: such a checkpoint is not
# skipped as damaged (an older one would fail the same way, and renaming it would hide a good one).
_NOT_DAMAGE = (MemoryError, TypeError, AttributeError, NameError, AssertionError, NotImplementedError)


def _is_damage(err: Exception) -> bool:
    """Whether an error while reading a checkpoint back says its files are damaged or incomplete."""
    text = str(err)
    return not isinstance(err, _NOT_DAMAGE) and "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text


class CheckpointStore:
    """A directory of checkpoints: async saves, restore of the newest good one, and rotation that keeps
    this run's ``keep`` newest steps and never touches another's (``read_only``: never writes at all).

    ``run_id`` identifies the run that saves here: :meth:`save` records it in every step's meta, and
    rotation deletes only steps that carry it. A new run sets a fresh one; a resumed run adopts the
    id of the checkpoint it resumed from (:meth:`adopt`).
    """

    def __init__(self, directory: str | Path, *, keep: int = 1, async_save: bool = True, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        # what opening the store creates (the directory and missing parents): a run that fails before it
        # saves anything removes it again (discard_if_unused)
        self.created = None if read_only else first_missing(self.directory)
        self.run_id: str | None = None
        self._saved: set[int] = set()
        self._owner: dict[int, str | None] = {}
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=1, enable_async_checkpointing=async_save, create=not read_only, read_only=read_only,
            preservation_policy=None if read_only else _KeepNewestOfThisRun(self, keep),
        )
        handlers = {
            "state": ocp.PyTreeCheckpointHandler(),
            "errors": ocp.PyTreeCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first (interrupted saves are never listed)."""
        return sorted(self._manager.all_steps(read=True))

    def adopt(self, meta: dict[str, Any]) -> None:
        """Continue the run that wrote ``meta`` (a resumed run): rotation may then remove its earlier
        steps. A checkpoint that records no run (an import) leaves a fresh id: it is never rotated."""
        self.run_id = meta.get("run") or uuid.uuid4().hex

    def owns(self, step: int) -> bool:
        """Whether this run wrote ``step`` (rotation may delete it)."""
        if step in self._saved:
            return True
        if step not in self._owner:
            meta = read_step_meta(self.directory, step)
            self._owner[step] = meta.get("run") if meta else None
        return self.run_id is not None and self._owner[step] == self.run_id

    def save(self, position: RunPosition, state: Any, errors: list[dict[str, Any]] | None, mesh,
             extra_meta: dict[str, Any]) -> None:
        """Start saving ``state`` (canonical layout) at ``position.step``; returns once the arrays are
        copied to host memory, while files are written in the background."""
        tree = {"state": state} if errors is None else {"state": state, "errors": errors}
        sums, finite = checksums(tree, mesh)
        if not finite:
            raise FloatingPointError(f"step {position.step}: the state holds NaN/Inf; not saving a poisoned checkpoint")
        meta = {
            "format": FORMAT_VERSION, "step": position.step, "updates": position.updates,
            "data_position": position.data_position, "data_cursor": position.data_cursor, "has_errors": errors is not None, "checksums": sums,
            "run": self.run_id, **extra_meta,
        }
        items = {"state": ocp.args.PyTreeSave(state), "meta": ocp.args.JsonSave(meta)}
        if errors is not None:
            items["errors"] = ocp.args.PyTreeSave(errors)
        self._saved.add(position.step)
        self._manager.save(position.step, args=ocp.args.Composite(**items))

    def wait(self) -> None:
        """Block until every save started so far is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def discard_if_unused(self, leftovers: Sequence[str] = ()) -> None:
        """Remove the directory this store created, with the parents it created, if nothing was saved
        in it (a run that failed before its first checkpoint); a directory that existed stays.
        ``leftovers``: files the run wrote there beside the checkpoints, removed with it."""
        if self.created is not None and jax.process_index() == 0:
            if not step_directories(self.directory):
                for name in (TRACKER_RUNS, *leftovers):
                    (self.directory / name).unlink(missing_ok=True)
            remove_if_empty(self.directory, self.created)

    def _set_aside(self, steps: list[int]) -> None:
        """Rename damaged step directories to ``<step>.damaged`` (kept for inspection, never deleted) so
        the resumed run can save those steps again."""
        if jax.process_index() == 0:
            for step in steps:
                source = self.directory / str(step)
                target = self.directory / f"{step}.damaged"
                suffix = 1
                while target.exists():
                    suffix += 1
                    target = self.directory / f"{step}.damaged.{suffix}"
                source.rename(target)
                _warn(f"moved {source} to {target.name}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("meshtron: damaged checkpoints set aside")
        self._manager.reload()

    def saved_tensors(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{dotted name: (shape, dtype)}`` of the state step ``step`` holds, from orbax's metadata."""
        return _saved_shapes(self._manager.item_metadata(step)["state"])

    def read_meta(self, step: int) -> dict[str, Any]:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"meta item is not a meshtron format-{FORMAT_VERSION} record")
        return meta

    def restore_newest(self, target_state: Any, target_errors: Any | None, mesh, *,
                       use_errors=lambda meta: False, resizable: frozenset[str] = frozenset(),
                       partial: bool = False, only: int | None = None,
                       source: str = "checkpoint.dir") -> Restored | None:
        """The newest checkpoint that reads back intact, on the shardings of ``target_state``
        (``ShapeDtypeStruct`` s); ``None`` when the directory has none. ``only``: that step and no
        other (no fallback to an older one).

        ``use_errors(meta)`` says whether the saved error buffers fit this run (then they are read
        onto ``target_errors``). Leaves named in ``resizable`` may have been saved with another
        leading size (vocabulary padding): they are cut or zero-padded to the target. Damaged
        checkpoints are skipped with a message and, unless the store is read-only, renamed out of the way of
        the resumed run's saves; a checkpoint of a different model raises :class:`CheckpointError`
        (its fix names ``source``, the setting that chose this checkpoint). With ``partial`` the
        target may name a subset of the saved tensors (``{"params": ...}`` to sample from a model
        without its optimizer state).
        """
        steps = self.steps()
        if only is not None:
            if only not in steps:
                raise CheckpointError(f"{source}: {self.directory} has no complete checkpoint of step {only} "
                                      f"(it has {steps or 'none'})")
            steps = [only]
        damaged: list[int] = []
        for step in reversed(steps):
            where = f"checkpoint {self.directory}/{step}"
            try:
                meta = self.read_meta(step)
                saved = self.saved_tensors(step)
                check_compatible(saved, target_state, where, resizable, partial, source)
                with_errors = target_errors is not None and meta.get("has_errors") and use_errors(meta)
                items = {"state": _restore_args(_as_saved(target_state, saved, mesh), partial)}
                if with_errors:
                    items["errors"] = _restore_args(target_errors, False)
                restored = self._manager.restore(step, args=ocp.args.Composite(**items))
                tree = {"state": restored["state"]}
                if with_errors:
                    tree["errors"] = restored["errors"]
                sums, _ = checksums(tree, mesh)
                bad = [name for name, value in sums.items() if meta["checksums"].get(name) != value]
                if bad:
                    raise ValueError(f"checksum mismatch in {len(bad)} tensor(s), first {bad[0]}")
            except CheckpointError:
                raise
            except Exception as err:  # a failure to read back the files means: damaged, try the one before
                reason = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
                if not _is_damage(err):  # the machine or the program failed, not the files: nothing is skipped
                    raise CheckpointError(
                        f"{where}: reading it failed ({type(err).__name__}: {reason}); that is not damage to its "
                        "files, so nothing was skipped or moved; fix the cause (memory? the devices?) and run again"
                    ) from err
                damaged.append((step, reason))
                _warn(f"{where} is damaged or incomplete ({reason}); skipping it")
                continue
            position = RunPosition(meta["step"], meta["updates"], meta["data_position"], meta.get("data_cursor"))
            state = _resize_to(restored["state"], target_state, mesh)
            errors = restored["errors"] if with_errors else None
            if damaged:
                if not self.read_only:
                    self._set_aside([s for s, _ in damaged])
                _warn(f"using step {step}, the newest intact checkpoint")
            return Restored(step, position, state, errors, meta)
        if damaged:
            what = "; ".join(f"step {s}: {reason}" for s, reason in damaged)
            raise CheckpointError(
                f"{source} {self.directory}: every checkpoint is damaged or incomplete ({what}); move them away "
                f"or choose another {source} to start afresh (nothing is deleted automatically)"
            )
        return None

