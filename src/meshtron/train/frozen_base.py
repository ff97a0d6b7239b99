"""Reading a model's parameters from a checkpoint, LoRA's adapter-only checkpoints included.

A LoRA run trains a few percent of the model; the rest -- the frozen base -- is exactly what it started
from. So by default its checkpoints hold the adapters and their optimizer state, and, in the meta
record, a pointer to the base (:class:`BasePointer`): the checkpoint the run read it from
(``train.init_from``: an import or another run) or the seed that made it. A 7B model's checkpoint
at rank 16 is then 0.48 GB per save (40 M adapter parameters and their AdamW moments, fp32) instead
of 81 GB (PEFT and Megatron-Bridge save adapters alone too). ``train.lora.save_base=true`` writes the
base into every checkpoint instead (self-contained: nothing else needs to stay on disk).

Every reader -- a resumed run, ``train.init_from``, ``generate``, ``export-hf`` -- goes through
:func:`read_params` or :func:`adapters_only_target` / :func:`with_base`: the base comes from the pointer, on
the reader's mesh, and the adapters from the checkpoint. If the base is gone, that is one line naming it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from meshtron.checkpoint import CheckpointError, CheckpointStore, abstract_like
from meshtron.checkpoint_dirs import read_step_meta
from meshtron.errors import ConfigError
from meshtron.models.lora import adapters_only, grafted, is_adapter, without_adapters
from meshtron.train.probed_state import absent_from, with_fresh_leaves, without_leaves
from meshtron.train.state import ModelDef, Params
from meshtron.trees import leaf_names

BASE_KEY = "lora_base"  # the meta record's field holding the pointer
PARAMS_PREFIX = "state.params."  # the parameters' names in a step's ``checksums`` (CheckpointStore.save)


def params_digest(meta: dict[str, Any] | None) -> str | None:
    """A SHA-256 (hex) of the base parameters' checksums in a step's meta record (sorted names and values;
    adapters left out, since a LoRA checkpoint's own adapters are not part of the base it provides);
    ``None`` when the record holds none.

    It needs no read of the weights, and it is the same whatever mesh wrote them: each checksum is an
    exact integer sum over the global array, and vocabulary padding only adds zero rows at the end.
    Restoring a step checks its tensors against these same checksums, so an equal digest means the
    same weights."""
    sums = (meta or {}).get("checksums")
    if not isinstance(sums, dict):
        return None
    base = sorted((name, int(value)) for name, value in sums.items()
                  if name.startswith(PARAMS_PREFIX) and not is_adapter(name))
    if not base:
        return None
    digest = hashlib.sha256()
    for name, value in base:
        digest.update(f"{name}={value}\n".encode())
    return digest.hexdigest()


def relative_path(directory: str, checkpoint_dir: str | Path) -> str | None:
    """``directory`` relative to the checkpoint directory (``../llama1b``), both symlinks resolved;
    ``None`` where there is no relative path (another drive on Windows)."""
    try:
        return os.path.relpath(Path(directory).resolve(), Path(checkpoint_dir).resolve())
    except ValueError:
        return None


def holds_base(directory: str, step: int | None, digest: str | None) -> bool:
    """Whether ``directory`` exists and -- when the pointer records the base's digest and step -- its
    step's parameter checksums agree with it."""
    if not Path(directory).is_dir():
        return False
    return digest is None or step is None or params_digest(read_step_meta(directory, step)) == digest


def located(recorded: str | None, relative: str | None, checkpoint_dir: str | Path | None, step: int | None,
            digest: str | None) -> str | None:
    """Where the base a pointer records is now: the relative path first (a base and a run moved together),
    then the absolute one; the first that holds the recorded base, else the first that exists (which
    :func:`read_base` refuses, naming it), else the recorded path (gone)."""
    joined = None
    if relative is not None and checkpoint_dir is not None:
        joined = str((Path(checkpoint_dir) / relative).resolve())
    candidates = [c for c in dict.fromkeys((joined, recorded)) if c is not None]
    existing = [c for c in candidates if Path(c).is_dir()]
    return next((c for c in existing if holds_base(c, step, digest)), existing[0] if existing else recorded or joined)


@dataclass(frozen=True)
class BasePointer:
    """Where a LoRA run's frozen base comes from: step ``step`` of the checkpoint directory ``directory``
    (absolute), whose parameters' checksums hash to ``digest`` (:func:`params_digest`; ``None`` in a pointer
    written before it was recorded: not checked), or -- ``directory`` None -- a new model from ``seed`` (which,
    with the model config the checkpoint records, is the base's identity: no digest).

    ``checkpoint``: the checkpoint directory whose meta record held the pointer, for messages."""

    directory: str | None
    step: int | None
    seed: int
    digest: str | None = None
    checkpoint: str | None = field(default=None, compare=False)

    def to_meta(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """The meta record's field, for a checkpoint written into ``checkpoint_dir``: ``dir`` (absolute),
        ``step`` and ``seed``; for a base read from a directory, also ``dir_relative`` (to
        ``checkpoint_dir``, tried first) and ``params_sha256``, when known."""
        out: dict[str, Any] = {"dir": self.directory, "step": self.step, "seed": self.seed}
        if self.directory is None:
            return out
        relative = relative_path(self.directory, checkpoint_dir)
        if relative is not None:
            out["dir_relative"] = relative
        if self.digest is not None:
            out["params_sha256"] = self.digest
        return out

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None, checkpoint_dir: str | Path | None) -> BasePointer | None:
        """The pointer the meta record of a checkpoint in ``checkpoint_dir`` holds, its directory
        :func:`located` where the base is now; ``None`` when the checkpoint holds its whole model."""
        found = (meta or {}).get(BASE_KEY)
        if not isinstance(found, dict):
            return None
        step, digest = found.get("step"), found.get("params_sha256")
        directory = located(found.get("dir"), found.get("dir_relative"), checkpoint_dir, step, digest)
        return cls(directory, step, int(found.get("seed", 0)), digest,
                   None if checkpoint_dir is None else str(checkpoint_dir))

    def describe(self) -> str:
        return f"a new model from seed {self.seed}" if self.directory is None else f"{self.directory}/{self.step}"


def newest_meta(store: CheckpointStore, step: int | None = None) -> dict[str, Any] | None:
    """The meta record of step ``step`` (default: the newest) of ``store``, read as JSON; ``None`` if none."""
    if step is None:
        steps = store.steps()
        if not steps:
            return None
        step = steps[-1]
    return read_step_meta(store.directory, step)


def holds_adapters(meta: dict[str, Any] | None) -> bool:
    """Whether the checkpoint of the meta record ``meta`` was written by a LoRA run (it holds adapters)."""
    config = (meta or {}).get("config") or {}
    return bool(((config.get("train") or {}).get("lora") or {}).get("rank"))


def read_base(pointer: BasePointer, model_def: ModelDef, mesh: Mesh, shardings: Params, source: str) -> Params:
    """The frozen base ``pointer`` names, canonical (layers in model order), on ``shardings`` (a whole
    model's: the adapters' are left out)."""
    if pointer.directory is None:
        return without_adapters(model_def.init(mesh, pointer.seed, shardings=shardings))
    gone = CheckpointError(f"{source}: an adapter-only LoRA checkpoint whose frozen base, {pointer.describe()}, is "
                           "gone; put the base back there, or use a checkpoint written with train.lora.save_base=true")
    if not Path(pointer.directory).is_dir():
        raise gone
    if pointer.step is not None:  # before reading the weights
        check_identity(pointer, read_step_meta(pointer.directory, pointer.step), source)
    target = {"params": abstract_like(without_adapters(model_def.shapes()), without_adapters(shardings))}
    store = CheckpointStore(pointer.directory, read_only=True)
    try:
        restored = store.restore_newest(target, None, mesh, resizable=model_def.resizable_in(target), partial=True,
                                        only=pointer.step, source=source)
    finally:
        store.close()
    if restored is None:
        raise gone
    check_identity(pointer, restored.meta, source)  # the step read (the newest, when the pointer names none)
    return restored.state["params"]


def check_identity(pointer: BasePointer, meta: dict[str, Any] | None, source: str) -> None:
    """Refuse a base whose parameters are not the ones the pointer recorded (another model of the same
    shape written where the base was): grafting the adapters onto it would give a different model
    silently. ``meta``: the base step's record; one that cannot be read is left to the restore, which
    names it."""
    found = params_digest(meta)
    if pointer.digest is None or found is None or found == pointer.digest:
        return
    raise CheckpointError(
        f"{source}: the frozen base of the adapter-only LoRA checkpoint {pointer.checkpoint}, {pointer.describe()}, "
        f"is not the model it was trained on (its parameter checksums differ from {BASE_KEY}.params_sha256); put "
        "the original base back there, or use a checkpoint written with train.lora.save_base=true")


def adapters_only_target(target: dict[str, Any], pointer: BasePointer | None) -> dict[str, Any]:
    """A restore target (``{"params": ..., ...}``) cut down to what the checkpoint holds: the adapters alone
    when it points to its base."""
    if pointer is None:
        return target
    return {**target, "params": adapters_only(target["params"])}


def check_read_alike(restored: Any, pointer: BasePointer | None, store: CheckpointStore, source: str) -> None:
    """Refuse a restored step (an older one, the newest being damaged) that does not hold its base the way
    the newest does, which the restore target was cut for."""
    if BasePointer.from_meta(restored.meta, store.directory) != pointer:
        raise CheckpointError(f"{source}: {store.directory}/{restored.step} and the newest step disagree on holding "
                              "their frozen base (train.lora.save_base changed); pass the step directory to read")


def with_base(state: dict[str, Any], pointer: BasePointer | None, model_def: ModelDef, mesh: Mesh,
              shardings: Params, source: str) -> dict[str, Any]:
    """A restored state (``{"params": ..., ...}``) made whole: the adapters grafted onto the base its
    checkpoint points to."""
    if pointer is None:
        return state
    base = read_base(pointer, model_def, mesh, shardings, source)
    return {**state, "params": grafted(base, state["params"])}


def absent_modules(meta: dict[str, Any] | None, shapes: Params) -> list[str]:
    """The top-level parameter subtrees of ``shapes`` (modules: ``mtp``, say) of which the checkpoint whose
    meta record is ``meta`` holds no leaf: the model that wrote it had no such module. Without checksums
    to tell, none."""
    checksums = (meta or {}).get("checksums")
    if not isinstance(checksums, dict):
        return []
    held = {name[len(PARAMS_PREFIX):].split(".")[0] for name in checksums if name.startswith(PARAMS_PREFIX)}
    return [key for key in shapes if key not in held]


def initialised_leaves(params: Params, model_def: ModelDef, mesh: Mesh, shardings: Params, names: list[str],
                       seed: int) -> Params:
    """``params`` (without the leaves of dotted ``names``) with those leaves as the model's initializer
    makes them from ``seed`` -- the values a new model of that seed has -- computed alone (the program
    keeps only those leaves of the initializer's work) and placed on ``shardings``."""
    if not names:
        return params

    def at(tree: Any, name: str) -> Any:
        for key in name.split("."):
            tree = tree[key]
        return tree

    def create() -> list[jax.Array]:
        with nnx.use_eager_sharding(False):
            model = model_def.factory(nnx.Rngs(params=seed))
        fresh = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return [at(fresh, name) for name in names]

    with jax.set_mesh(mesh), model_def.scope():
        values = jax.jit(create, out_shardings=[at(shardings, name) for name in names])()
    out = dict(params)
    for name, value in zip(names, values, strict=True):
        node = out
        *parents, last = name.split(".")
        for key in parents:
            node[key] = dict(node.get(key, {}))
            node = node[key]
        node[last] = value
    return out


def read_params(store: CheckpointStore, model_def: ModelDef, mesh: Mesh, shardings: Params, *, step: int | None,
                source: str, seed: int, new_modules: bool = False) -> tuple[Params, dict[str, Any]]:
    """The parameters (no optimizer state) of step ``step`` (default: the newest intact one) of ``store``,
    canonical, on ``shardings``, and that checkpoint's meta record.

    A checkpoint of a LoRA run whose base it only points to gets its base back; a model with adapters
    read from a checkpoint without them (LoRA on an import) gets fresh ones from ``seed``. With
    ``new_modules`` (a run started from another's weights), modules of the model the checkpoint has no
    leaf of (:func:`absent_modules`: multi-token prediction added to a model trained without it) start
    from the model's initializer with ``seed``, and a line on stderr names them."""
    lora = model_def.adaptation is not None
    meta = newest_meta(store, step)
    has_adapters = holds_adapters(meta)
    if has_adapters and not lora:
        raise ConfigError(f"{source}: {store.directory} holds LoRA adapters; set the same train.lora to use or go "
                          "on training them, or export-hf it (which merges them) and start from that")
    pointer = BasePointer.from_meta(meta, store.directory)
    shapes, target_shardings = model_def.shapes(), shardings
    if lora and not has_adapters:  # LoRA on a model trained without: its weights, and adapters made here
        shapes, target_shardings = without_adapters(shapes), without_adapters(shardings)
    kept = [n for n, k in zip(leaf_names(model_def.shapes()), jax.tree.leaves(model_def.probed_state()), strict=True)
            if k]
    # state a model trained without it lacks (delayed FP8's history, a selection bias), made fresh; a checkpoint
    # that points to its base gets it with the base
    fresh = [] if pointer is not None else absent_from((meta or {}).get("checksums"), kept, PARAMS_PREFIX)
    modules = absent_modules(meta, shapes) if new_modules and pointer is None else []
    made = [name for name in leaf_names(shapes) if name.split(".")[0] in modules]
    fresh = [name for name in fresh if name.split(".")[0] not in modules]
    shapes, target_shardings = (without_leaves(tree, fresh + made) for tree in (shapes, target_shardings))
    target = adapters_only_target({"params": abstract_like(shapes, target_shardings)}, pointer)
    restored = store.restore_newest(target, None, mesh, resizable=model_def.resizable_in(target), partial=True,
                                    only=step, source=source)
    if restored is None:
        raise ConfigError(f"{source}: {store.directory} holds no checkpoint; give a run's checkpoint.dir, an "
                          "import, or one of their step directories")
    check_read_alike(restored, pointer, store, source)
    params = with_base(restored.state, pointer, model_def, mesh, shardings, source)["params"]
    if lora and not has_adapters:
        params = grafted(params, adapters_only(model_def.init(mesh, seed, shardings=shardings)))
    params = with_fresh_leaves(params, model_def.shapes(), shardings, fresh)
    if made:
        params = initialised_leaves(params, model_def, mesh, shardings, made, seed)
        if jax.process_index() == 0:
            print(f"meshtron: {source}: {store.directory} has no {', '.join(modules)} parameters ({len(made)} "
                  f"tensors): they start from the model's initializer (seed {seed})", file=sys.stderr)
    return params, restored.meta
