"""GPT-style training samples from an indexed token dataset: windows of ``seq_len + 1`` tokens over
a shuffled stream of documents, Megatron's ``GPTDataset`` idea.

How sample ``i`` is found, from the documents' token counts only (``.idx``), never the tokens:

* **Split.** The last ``holdout_fraction`` of the dataset's documents (at least one, rounded) are
  the held-out split, the rest the training split: the two never share a document. Documents with
  no tokens are left out.
* **Epochs.** Epoch ``e`` lays the split's documents end to end in an order shuffled by
  ``(seed, split, e)``. Window ``j`` of an epoch is the ``seq_len + 1`` tokens from stream position
  ``j * seq_len``: consecutive windows overlap by one token (the last target of one is the first
  input of the next, as Megatron's samples do) and cross document boundaries freely. An epoch has
  ``(tokens - 1) // seq_len`` windows; the few tokens after the last one are not used that epoch.
* **Shuffle.** The windows of epoch ``e`` are taken in a permutation seeded by ``(seed, split, e)``;
  sample ``i`` is window ``perm_e[i mod W]`` of epoch ``e = i // W`` (``W`` windows an epoch).

Unlike Megatron, whose document order and sample shuffle span all the epochs a run needs (so they
change with the requested number of samples), every epoch here is shuffled on its own: sample ``i``
depends only on ``(seed, seq_len, split, holdout_fraction, the data)``, not on ``num_samples``.
The same ``sample(i)`` comes out in every process and after a restart, a longer run repeats a
shorter one's samples first, and resuming is the caller keeping the next sample index.

Building an epoch is three vectorised passes over the document count (a permutation, a cumulative
sum, a permutation of the windows): well under a second for a million documents. Two epochs are
kept; a sample reads only its own slices of the memory-mapped ``.bin``.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from pathlib import Path

import numpy as np

from meshtron.data.indexed import IndexedDataset
from meshtron.errors import ConfigError

SPLITS = {"train": 0, "heldout": 1}
_CACHED_EPOCHS = 2


def holdout_documents(num_documents: int, holdout_fraction: float) -> int:
    """How many trailing documents are held out: ``round(n * fraction)``, at least 1 unless the
    fraction is 0."""
    if holdout_fraction <= 0:
        return 0
    return max(1, round(num_documents * holdout_fraction))


def split_range(n: int, holdout_fraction: float, split: str, name: str, unit: str = "documents") -> tuple[int, int]:
    """``(first, stop)``: the documents of ``split`` among ``n`` (the held-out ones are the last); one
    line naming ``data.holdout_fraction`` when that leaves a split empty."""
    held = holdout_documents(n, holdout_fraction)
    if split == "heldout" and held == 0:
        raise ConfigError(f"data.holdout_fraction: is 0, so {name!r} has no held-out {unit}; set it above 0")
    if n - held < 1:
        raise ConfigError(f"data.holdout_fraction: {holdout_fraction} of {name!r}'s {n} {unit} leaves none "
                          f"for training; lower it or use a dataset with more {unit}")
    return (0, n - held) if split == "train" else (n - held, n)


def _small_int(values: np.ndarray) -> np.ndarray:
    return values.astype(np.int32) if len(values) < 2**31 else values


class TokenWindows:
    """Samples ``[seq_len + 1]`` (int32) of one split of an indexed dataset; see the module doc.

    ``dataset``: an :class:`IndexedDataset` or its prefix. ``num_samples``: the length (None: one
    epoch's windows); more than an epoch repeats the documents in new orders. ``sample(i)`` for
    ``0 <= i < len(self)``; ``samples(indices)`` stacks several.
    """

    def __init__(self, dataset: IndexedDataset | str | Path, *, seq_len: int, seed: int, split: str = "train",
                 holdout_fraction: float = 0.1, num_samples: int | None = None, reset_per_document: bool = False):
        self.dataset = dataset if isinstance(dataset, IndexedDataset) else IndexedDataset(dataset)
        if split not in SPLITS:
            raise ConfigError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
        if not isinstance(seq_len, int | np.integer) or seq_len < 1:
            raise ConfigError(f"model.seq_len: must be a positive integer, got {seq_len!r}")
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise ConfigError(f"train.seed: must be a non-negative integer, got {seed!r}")
        if not 0 <= holdout_fraction < 1:
            raise ConfigError(f"data.holdout_fraction: must be in [0, 1), got {holdout_fraction!r}")
        self.seq_len, self.seed, self.split = int(seq_len), int(seed), split
        self.reset_per_document = reset_per_document
        self.holdout_fraction = holdout_fraction
        name = self.dataset.prefix
        first, stop = split_range(self.dataset.num_documents, holdout_fraction, split, name)
        self.first_document, self.stop_document = first, stop
        offsets = self.dataset.document_token_offsets()[first : stop + 1]
        lengths = np.diff(offsets)
        keep = lengths > 0
        self._documents = _small_int(np.flatnonzero(keep) + first)  # dataset document numbers
        self._starts = offsets[:-1][keep]
        self._lengths = lengths[keep]
        self.tokens_per_epoch = int(self._lengths.sum())
        self.samples_per_epoch = (self.tokens_per_epoch - 1) // self.seq_len if self.tokens_per_epoch else 0
        if self.samples_per_epoch < 1:
            raise ConfigError(f"model.seq_len: the {split} split of {name!r} ({stop - first} documents) has "
                              f"{self.tokens_per_epoch} tokens, fewer than one sample of seq_len + 1 = "
                              f"{self.seq_len + 1}; use more data, a smaller seq_len or another holdout_fraction")
        if num_samples is not None and (not isinstance(num_samples, int | np.integer) or num_samples < 0):
            raise ConfigError(f"num_samples: must be a non-negative integer or None, got {num_samples!r}")
        self.num_samples = self.samples_per_epoch if num_samples is None else int(num_samples)
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def __repr__(self) -> str:
        return (f"TokenWindows({self.dataset.prefix!r}, split={self.split}, seq_len={self.seq_len}, "
                f"seed={self.seed}: {self.num_samples} samples, {self.samples_per_epoch} an epoch)")

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_documents(self) -> int:
        """Documents of this split that hold tokens."""
        return len(self._lengths)

    @property
    def documents(self) -> np.ndarray:
        """The dataset's document numbers in this split (those with tokens), ascending."""
        return self._documents

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order: positions into this split's documents, ends: cumulative tokens in that order,
        perm: the epoch's window permutation)."""
        cached = self._epochs.get(epoch)
        if cached is not None:
            self._epochs.move_to_end(epoch)
            return cached
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[self.split], epoch]))
        order = _small_int(rng.permutation(len(self._lengths)))
        ends = np.cumsum(self._lengths[order])
        perm = _small_int(rng.permutation(self.samples_per_epoch))
        self._epochs[epoch] = built = (order, ends, perm)
        while len(self._epochs) > _CACHED_EPOCHS:
            self._epochs.popitem(last=False)
        return built

    def epoch_documents(self, epoch: int) -> np.ndarray:
        """The dataset's document numbers in the order epoch ``epoch`` lays them end to end."""
        return self._documents[self._epoch(epoch)[0]]

    def window(self, index: int) -> tuple[int, int]:
        """``(epoch, start)``: sample ``index`` is tokens ``start .. start + seq_len`` of that epoch's
        document stream (:meth:`epoch_documents` concatenated)."""
        index = operator.index(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        epoch, within = divmod(index, self.samples_per_epoch)
        return epoch, int(self._epoch(epoch)[2][within]) * self.seq_len

    def sample(self, index: int) -> np.ndarray:
        """Sample ``index``: ``seq_len + 1`` tokens (int32), inputs ``[:-1]`` and targets ``[1:]``. With
        ``reset_per_document``: ``[seq_len + 1, 3]``, each token with its document's number within the window
        (from 1) and a loss mask of ones (:mod:`meshtron.models.documents`): Megatron's
        ``--reset-attention-mask --reset-position-ids --eod-mask-loss``, from the index's boundaries."""
        epoch, start = self.window(index)
        order, ends, _ = self._epoch(epoch)
        k = int(np.searchsorted(ends, start, side="right"))
        offset = start - (int(ends[k - 1]) if k else 0)
        out = np.empty(self.seq_len + 1, np.int32)
        segments = np.empty(self.seq_len + 1, np.int32)
        filled, segment = 0, 1
        while filled < len(out):
            doc = int(order[k])
            take = min(len(out) - filled, int(self._lengths[doc]) - offset)
            out[filled : filled + take] = self.dataset.read(int(self._starts[doc]) + offset, take)
            segments[filled : filled + take] = segment
            filled += take
            k, offset, segment = k + 1, 0, segment + 1
        if self.reset_per_document:
            return np.stack([out, segments, np.ones_like(out)], axis=-1)
        return out

    def samples(self, indices) -> np.ndarray:
        """Samples ``indices`` stacked: ``[len(indices), seq_len + 1]`` int32 (``[..., 3]`` with ``reset_per_document``)."""
        return np.stack([self.sample(index) for index in indices]).astype(np.int32)
