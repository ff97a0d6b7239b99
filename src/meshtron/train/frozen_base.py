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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from meshtron.checkpoint import CheckpointError, CheckpointStore, abstract_like
from meshtron.checkpoint_dirs import read_step_meta
from meshtron.errors import ConfigError
from meshtron.models.lora import adapters_only, grafted, without_adapters
from meshtron.train.state import ModelDef, Params

BASE_KEY = "lora_base"  # the meta record's field holding the pointer


@dataclass(frozen=True)
class BasePointer:
    """Where a LoRA run's frozen base comes from: step ``step`` of the checkpoint directory ``directory``
    (absolute), or -- ``directory`` None -- a new model from ``seed``."""

    directory: str | None
    step: int | None
    seed: int

    def to_meta(self) -> dict[str, Any]:
        return {"dir": self.directory, "step": self.step, "seed": self.seed}

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> BasePointer | None:
        """The pointer an adapter-only checkpoint's meta record holds; ``None`` when the checkpoint holds
        its whole model."""
        found = (meta or {}).get(BASE_KEY)
        if not isinstance(found, dict):
            return None
        return cls(found.get("dir"), found.get("step"), int(found.get("seed", 0)))

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
    target = {"params": abstract_like(without_adapters(model_def.shapes()), without_adapters(shardings))}
    store = CheckpointStore(pointer.directory, read_only=True)
    try:
        restored = store.restore_newest(target, None, mesh, resizable=model_def.resizable_in(target), partial=True,
                                        only=pointer.step, source=source)
    finally:
        store.close()
    if restored is None:
        raise gone
    return restored.state["params"]


def adapters_only_target(target: dict[str, Any], pointer: BasePointer | None) -> dict[str, Any]:
    """A restore target (``{"params": ..., ...}``) cut down to what the checkpoint holds: the adapters alone
    when it points to its base."""
    if pointer is None:
        return target
    return {**target, "params": adapters_only(target["params"])}


def check_read_alike(restored: Any, pointer: BasePointer | None, store: CheckpointStore, source: str) -> None:
    """Refuse a restored step (an older one, the newest being damaged) that does not hold its base the way
    the newest does, which the restore target was cut for."""
    if BasePointer.from_meta(restored.meta) != pointer:
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


def read_params(store: CheckpointStore, model_def: ModelDef, mesh: Mesh, shardings: Params, *, step: int | None,
                source: str, seed: int) -> tuple[Params, dict[str, Any]]:
    """The parameters (no optimizer state) of step ``step`` (default: the newest intact one) of ``store``,
    canonical, on ``shardings``, and that checkpoint's meta record.

    A checkpoint of a LoRA run whose base it only points to gets its base back; a model with adapters
    read from a checkpoint without them (LoRA on an import) gets fresh ones from ``seed``."""
    lora = model_def.lora is not None
    meta = newest_meta(store, step)
    has_adapters = holds_adapters(meta)
    if has_adapters and not lora:
        raise ConfigError(f"{source}: {store.directory} holds LoRA adapters; set the same train.lora to use or go "
                          "on training them, or export-hf it (which merges them) and start from that")
    pointer = BasePointer.from_meta(meta)
    shapes, target_shardings = model_def.shapes(), shardings
    if lora and not has_adapters:  # LoRA on a model trained without: its weights, and adapters made here
        shapes, target_shardings = without_adapters(shapes), without_adapters(shardings)
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
    return params, restored.meta
