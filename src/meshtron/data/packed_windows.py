"""Windows of whole items (fine-tuning examples, preference pairs) packed greedily, epoch after epoch.

Each epoch shuffles the items on its own (seeded by the run's seed, the split and the epoch) and packs
them in that order: an item joins the current window while the window's rule says it fits, else it
starts the next one. Epochs are laid end to end, so sample ``i`` is a window of some epoch; epochs differ
in their number of windows, so they are built in order as far as a sample asks, and only the last few
are kept built (a run reads them in order). What a window holds depends only on the seed, the split and
the items' sizes: a resumed run rebuilds the same windows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from meshtron.data.samples import SPLITS

__all__ = ["PackedWindows"]

_CACHED_EPOCHS = 2  # packed epochs kept built


class PackedWindows:
    """The epochs' packing of ``count`` items: ``bounds(order)`` gives, for items in ``order``, the
    positions where a new window starts (after the first, which starts at 0)."""

    def __init__(self, count: int, seed: int, split: str, bounds: Callable[[np.ndarray], list[int]]):
        self.count, self.seed, self.split = int(count), int(seed), split
        self._bounds = bounds
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._first_window = [0]  # window number each built epoch starts at
        self.per_epoch = len(self.epoch(0)[1]) - 1  # windows of the first epoch

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order: the items in the epoch's order, bounds: window k holds ``order[bounds[k]:bounds[k+1]]``)."""
        cached = self._epochs.get(epoch)
        if cached is not None:
            return cached
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[self.split], epoch]))
        order = rng.permutation(self.count)
        self._epochs[epoch] = built = (order, np.asarray([0, *self._bounds(order), len(order)]))
        while len(self._epochs) > _CACHED_EPOCHS:
            self._epochs.popitem(last=False)
        return built

    def locate(self, index: int) -> tuple[int, int]:
        """(epoch, window within it) of sample ``index``."""
        while len(self._first_window) <= 1 or self._first_window[-1] <= index:
            epoch = len(self._first_window) - 1
            self._first_window.append(self._first_window[-1] + len(self.epoch(epoch)[1]) - 1)
        epoch = int(np.searchsorted(self._first_window, index, side="right")) - 1
        return epoch, index - self._first_window[epoch]

    def items(self, index: int) -> np.ndarray:
        """The items sample ``index`` holds, in the order it holds them."""
        epoch, window = self.locate(index)
        order, bounds = self.epoch(epoch)
        return order[bounds[window] : bounds[window + 1]]
