"""Blends of indexed datasets by weight, with Megatron-LM's rule.

``data.blend`` is Megatron's flat list ``[w1, prefix1, w2, prefix2, ...]`` (:func:`parse_blend`).
Weights are normalised to sum to 1. Blended sample ``i`` comes from the dataset furthest behind its
share: the ``d`` maximising ``weights[d] * max(i, 1) - taken[d]`` (``taken[d]``: samples drawn from
``d`` before ``i``), the lowest ``d`` on a tie, and is that dataset's next sample ``taken[d]``. This is
``build_blending_indices`` in Megatron-core's ``megatron/core/datasets/helpers.cpp`` (note
``max(i, 1)``, not ``i + 1``: samples 0 and 1 both compare against one sample's worth), in the
same float64 arithmetic, so the two give identical sequences. A dataset of weight 0 is never drawn
(Megatron refuses one). The draw is online, so the first ``n`` blended samples are the same for
every ``num_samples >= n``.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from meshtron.data.samples import TokenWindows
from meshtron.errors import ConfigError


class Blend(NamedTuple):
    """A parsed ``data.blend``: the weights, normalised to sum to 1, and the dataset prefixes
    (``weights, prefixes = parse_blend(...)``)."""

    weights: list[float]
    prefixes: list[str]


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def normalize(weights: Sequence[float]) -> list[float]:
    """``weights / sum(weights)`` in float64 (Megatron's ``normalize``)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def parse_blend(blend: Any) -> Blend:
    """``[w1, prefix1, w2, prefix2, ...]`` (numbers or numeric strings as weights) -> :class:`Blend`.
    A fault is one :class:`ConfigError` (``data.blend: ...``)."""
    usage = "give [w1, prefix1, w2, prefix2, ...] (a weight before each dataset prefix)"
    if isinstance(blend, str | bytes) or not isinstance(blend, Sequence):
        raise ConfigError(f"data.blend: expected a list, got {blend!r}; {usage}")
    if not blend:
        raise ConfigError(f"data.blend: is empty; {usage}")
    if len(blend) % 2:
        raise ConfigError(f"data.blend: has {len(blend)} entries, an odd number; {usage}")
    prefixes, weights = [], []
    for pair in range(len(blend) // 2):
        raw_weight, raw_prefix = blend[2 * pair], blend[2 * pair + 1]
        weight = _number(raw_weight)
        if weight is None:
            raise ConfigError(f"data.blend: entry {2 * pair} ({raw_weight!r}) is not a number; {usage}")
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"data.blend: weight {raw_weight!r} (entry {2 * pair}) must be a finite number >= 0")
        if not isinstance(raw_prefix, str | Path) or not str(raw_prefix).strip() or _number(raw_prefix) is not None:
            raise ConfigError(f"data.blend: entry {2 * pair + 1} ({raw_prefix!r}) should be the prefix of an indexed "
                              f"dataset (PREFIX.bin + PREFIX.idx) after weight {raw_weight!r}; {usage}")
        prefixes.append(str(raw_prefix).strip())
        weights.append(weight)
    if sum(weights) <= 0:
        raise ConfigError("data.blend: every weight is 0; give at least one dataset a positive weight")
    return Blend(normalize(weights), prefixes)


def blend_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``build_blending_indices``: for each blended sample, the dataset (int16) and the
    index of the sample within it (int64). ``weights`` are normalised here."""
    w = normalize(weights)
    live = [d for d, x in enumerate(w) if x > 0]
    live_w = [w[d] for d in live]
    taken = [0] * len(live)
    dataset_index = np.empty(num_samples, np.int16)
    sample_index = np.empty(num_samples, np.int64)
    choice_dataset, choice_sample = [0] * num_samples, [0] * num_samples
    pairs = list(enumerate(live_w))
    for i in range(num_samples):
        scale = float(i) if i > 1 else 1.0
        best, best_error = 0, live_w[0] * scale - taken[0]
        for j, weight in pairs[1:]:
            error = weight * scale - taken[j]
            if error > best_error:
                best, best_error = j, error
        choice_dataset[i] = live[best]
        choice_sample[i] = taken[best]
        taken[best] += 1
    dataset_index[:] = choice_dataset
    sample_index[:] = choice_sample
    return dataset_index, sample_index


def split_windows(prefix: str, *, documents: bool = False, pairs_per_window: int = 1, **kwargs: Any) -> Any:
    """The windows of one split of the indexed dataset ``prefix``: whole examples packed
    (:class:`~meshtron.data.sft.PackedExamples`) for supervised fine-tuning data, pairs
    (:class:`~meshtron.data.preference.PreferencePairs`) for preference data, else windows over the
    document stream (:class:`TokenWindows`), as packed documents when ``documents``; pairs packed up to
    ``pairs_per_window`` a window pair (:class:`~meshtron.data.preference.PackedPairs`) when above 1.
    ``kwargs``: ``seq_len``, ``seed``, ``split``, ``holdout_fraction``, ``num_samples``."""
    from meshtron.data.preference import PackedPairs, PreferencePairs, is_preference
    from meshtron.data.sft import PackedExamples, has_loss_mask

    if is_preference(prefix):
        if pairs_per_window > 1:
            return PackedPairs(prefix, pairs_per_window=pairs_per_window, **kwargs)
        return PreferencePairs(prefix, **kwargs)
    if has_loss_mask(prefix):
        return PackedExamples(prefix, **kwargs)
    return TokenWindows(prefix, reset_per_document=documents, **kwargs)


class BlendedSamples:
    """``num_samples`` samples drawn from ``datasets`` by ``weights`` (see the module doc).

    ``datasets``: anything with ``len`` and ``sample(i)`` (e.g. :class:`TokenWindows`), each long enough
    for its share (:meth:`from_blend` builds them so). ``source(i)`` is ``(dataset, index within it)``;
    ``sample(i)`` reads it.
    """

    def __init__(self, weights: Sequence[float], datasets: Sequence, num_samples: int, *,
                 names: Sequence[str] | None = None):
        if len(weights) != len(datasets) or not datasets:
            raise ConfigError(f"data.blend: {len(weights)} weights for {len(datasets)} datasets; give one weight "
                              "per dataset")
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"data.blend: weights {list(weights)} must be finite, >= 0 and not all 0")
        if num_samples < 0:
            raise ConfigError(f"num_samples: must be >= 0, got {num_samples}")
        self.weights = normalize(weights)
        self.datasets = list(datasets)
        self.names = list(names) if names is not None else [getattr(getattr(d, "dataset", None), "prefix", f"#{k}")
                                                            for k, d in enumerate(datasets)]
        self.num_samples = int(num_samples)
        self.dataset_index, self.dataset_sample_index = blend_indices(self.weights, self.num_samples)
        self.counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (count, dataset) in enumerate(zip(self.counts, self.datasets)):
            if count > len(dataset):
                raise ConfigError(f"data.blend: the blend draws {count} samples from dataset {d} ({self.names[d]}) "
                                  f"but it has {len(dataset)}; build it with num_samples >= {count} "
                                  "(BlendedSamples.from_blend does)")

    @classmethod
    def from_blend(cls, blend: Any, *, seq_len: int, seed: int, num_samples: int, split: str = "train",
                   holdout_fraction: float = 0.1, documents: bool = False) -> BlendedSamples:
        """The blend ``data.blend`` (a raw list or a :class:`Blend`) of :func:`split_windows`, each
        as long as its share of ``num_samples``."""
        parsed = blend if isinstance(blend, Blend) else parse_blend(blend)
        counts = np.bincount(blend_indices(parsed.weights, num_samples)[0], minlength=len(parsed.prefixes))
        datasets = [split_windows(prefix, seq_len=seq_len, seed=seed, split=split, holdout_fraction=holdout_fraction,
                                  num_samples=int(count), documents=documents)
                    for prefix, count in zip(parsed.prefixes, counts)]
        return cls(parsed.weights, datasets, num_samples, names=parsed.prefixes)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.3g} {n}" for w, n in zip(self.weights, self.names))
        return f"BlendedSamples({parts}: {self.num_samples} samples)"

    def source(self, index: int) -> tuple[int, int]:
        """``(dataset, sample index within it)`` of blended sample ``index``."""
        index = operator.index(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        return int(self.dataset_index[index]), int(self.dataset_sample_index[index])

    def sample(self, index: int) -> np.ndarray:
        dataset, within = self.source(index)
        return self.datasets[dataset].sample(within)

    def samples(self, indices) -> np.ndarray:
        """Samples ``indices`` stacked (``[len(indices), seq_len + 1]`` for TokenWindows)."""
        return np.stack([self.sample(i) for i in indices])
