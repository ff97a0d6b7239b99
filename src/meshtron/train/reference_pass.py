"""DPO's reference before the first step: the precomputed one (``train.dpo.precompute_reference``), the
reference model's summed answer log-probabilities of every pair computed once before training, or the frozen
copy's weights, which every step then takes beside its batch (:func:`prepare_reference`).

**When and with what.** At the start of a run (step 0), with the weights the run starts from (those of
``train.init_from``: the model being aligned is its own reference), one forward pass over each distinct
pair of the training and held-out splits, ``train.batch_size`` pairs at a time, in the dataset's order.
Keyed by pair (not by the run's sample order), each pair is computed once however many epochs the run
draws; the samples then carry their pair's values (:attr:`meshtron.data.preference.PreferencePairs.reference`).

**Kept where.** In memory for the run, and in ``checkpoint.dir`` as :data:`REFERENCE_FILE` (written under a
temporary name and renamed), beside the checkpoints: a resumed run, whose weights are no longer the
reference, reads them from there instead of recomputing. The file records what it was computed for (the
dataset, ``model.seq_len``, the split's pair counts, ``train.init_from``); a resumed run whose file is
missing or was computed for other data refuses in one line. A run that fails before its first
checkpoint removes the file with the directory it created
(:meth:`meshtron.checkpoint.CheckpointStore.discard_if_unused`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshtron.checkpoint import CheckpointStore
from meshtron.data.preference import PreferencePairs
from meshtron.errors import ConfigError
from meshtron.train.objective import frozen_copy
from meshtron.train.state import Params

__all__ = ["REFERENCE_FILE", "as_is", "attach_reference", "frozen_reference", "prepare_reference", "reference_logps"]

REFERENCE_FILE = "reference_logps.npz"
SPLITS = ("train", "heldout")


def reference_logps(steps: Any, params: Params, pairs: PreferencePairs, batch_pairs: int) -> np.ndarray:
    """``[num_pairs, 2]`` fp32: the (chosen, rejected) summed answer log-probabilities of every pair of
    ``pairs`` under ``params``, ``batch_pairs`` pairs a forward (the last batch padded with its last pair)
    through ``steps.row_logps`` (:class:`meshtron.train.step.TrainSteps`; in a pipeline its forward-only
    schedule, each stage's layers on their own devices)."""
    n = pairs.num_pairs
    found = np.empty((n, 2), np.float32)
    for first in range(0, n, batch_pairs):
        chosen = [min(first + k, n - 1) for k in range(batch_pairs)]
        windows = np.concatenate([pairs.pair(p) for p in chosen])  # [2·batch_pairs, seq + 1, 3], pair by pair
        rows = steps.row_logps(params, windows).reshape(-1, 2)
        take = min(batch_pairs, n - first)
        found[first:first + take] = rows[:take]
    return found


def _key(cfg: Any, splits: dict[str, PreferencePairs]) -> dict[str, Any]:
    """What the values depend on besides the weights (recorded in the file, compared on resume)."""
    first = splits["train"]
    return {"data": str(first.dataset.prefix), "seq_len": first.seq_len, "init_from": cfg.train.init_from,
            "pairs": {name: s.num_pairs for name, s in splits.items()}}


def attach_reference(cfg: Any, steps: Any, params: Params, splits: dict[str, PreferencePairs],
                     store: CheckpointStore | None, resumed: bool) -> str:
    """Give every split of ``splits`` its pairs' reference log-probabilities: read from ``store`` when it
    holds them for this data, else (a run at step 0) computed with ``params`` and written there. Returns one
    line saying which."""
    key = _key(cfg, splits)
    path = None if store is None else Path(store.directory) / REFERENCE_FILE
    saved = _read(path, key)
    if saved is not None:
        for name, s in splits.items():
            s.reference = saved[name]
        return f"reference: log-probabilities of {key['pairs']['train']} pairs read from {path}"
    if resumed:
        raise ConfigError(f"checkpoint.dir: resumes a DPO run with train.dpo.precompute_reference, but {path} is "
                          "missing or was computed for other data or weights; resume with the run's own data and "
                          "checkpoint.dir, or start the run afresh in a new checkpoint.dir")
    for s in splits.values():
        s.reference = None  # the pass reads the plain windows
    values = {name: reference_logps(steps, params, s, cfg.train.batch_size) for name, s in splits.items()}
    for name, s in splits.items():
        s.reference = values[name]
    if path is None:
        return f"reference: log-probabilities of {key['pairs']['train']} pairs computed (kept in memory)"
    _write(path, key, values)
    return f"reference: log-probabilities of {key['pairs']['train']} pairs computed, saved to {path}"


def prepare_reference(trainer: Any, params: Params, store: CheckpointStore | None, resumed: bool,
                      say: Callable[..., None]) -> Callable[[Any], Any]:
    """What a run needs of DPO's reference before its first step, and what it does to each batch: the frozen
    copy of the starting weights goes beside every batch (:func:`frozen_reference`); the precomputed reference
    is given to the pairs (:func:`attach_reference`, with ``params``) and batches stay as they are, as they do
    without either. ``trainer``: a :class:`meshtron.train.loop.Trainer`; ``say`` prints one line of which."""
    cfg, steps = trainer.cfg, trainer.steps
    if frozen_copy(cfg):
        say("reference: a frozen copy of the starting weights, an argument of every step, which runs its forward",
            soft_wrap=True)
        return frozen_reference(trainer)
    if cfg.train.objective == "dpo" and cfg.train.dpo.precompute_reference:
        splits = {"train": trainer.corpus.train, "heldout": trainer.corpus.heldout}
        say(attach_reference(cfg, steps, params, splits, store, resumed), soft_wrap=True)
    return as_is


def frozen_reference(trainer: Any) -> Callable[[Any], Any]:
    """Each batch with the frozen copy of the starting weights beside it, what the step takes
    (:meth:`meshtron.train.step.TrainSteps.inputs`): the weights read once (with ``trainer.weights``,
    :meth:`meshtron.train.resume.WeightsIO.reference_params`) and laid out for the step."""
    steps = trainer.steps
    reference = jax.device_put(trainer.weights.reference_params(), steps.reference_shardings)
    return functools.partial(steps.inputs, reference=reference)


def as_is(batch: Any) -> Any:
    """A batch that needs nothing added."""
    return batch


def _read(path: Path | None, key: dict[str, Any]) -> dict[str, np.ndarray] | None:
    if path is None or not path.exists():
        return None
    with np.load(path) as saved:
        if json.loads(str(saved["key"])) != key:
            return None
        return {name: np.asarray(saved[name], np.float32) for name in SPLITS}


def _write(path: Path, key: dict[str, Any], values: dict[str, np.ndarray]) -> None:
    if jax.process_index() != 0:
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        np.savez(f, key=np.asarray(json.dumps(key)), **values)
    os.replace(temporary, path)
