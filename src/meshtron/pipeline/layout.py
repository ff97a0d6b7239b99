"""Which layers each pipeline stage runs: even splits and uneven ones (``parallel.layout``).

Real models rarely split evenly: the first stage also embeds, the last also runs the head and the
loss, and a layer count need not be a multiple of ``p·v``. Megatron-LM takes first/last-stage layer
counts or a layout string (``--pipeline-model-parallel-layout "Et*3|t*4|t*4|t*3L"``); wrong-depth
runs there have gone unnoticed (Megatron-LM #1304, #1778), so here a layout that does not add up to
the model is an error that says by how much.

A :class:`StageLayout` gives the number of layers of every *virtual* stage ``k = chunk·p + stage``
(Megatron's order: all stages' first chunks, then their second chunks, ...). Virtual stage ``k``
runs the canonical layers ``start_k … start_k + n_k - 1`` in order, so the model is the same
whatever the layout. In one SPMD program every stage holds arrays of one shape, so each chunk is
padded to the largest count: padded layer slots hold zeros and are skipped (the runtime runs a
chunk's first ``n_k`` layers; the rest pass the activation through). The cost of an uneven layout
is that padding, in parameter and optimizer memory, on the stages with fewer layers.

Accepted forms of ``parallel.layout``:

* a list of ``p·v`` layer counts, e.g. ``[3, 5]`` or ``"3,5"``;
* a Megatron-style string: virtual stages separated by ``|``, ``t`` a transformer layer, ``E`` the
  embedding (first virtual stage only, where meshtron runs it), ``L`` the loss (last only),
  ``X*N`` repeats a symbol and ``(…)*N`` a group (which may contain ``|``), e.g.
  ``"Et|t*3"`` or ``"E(tt|)*3tL"``. E and L may be left out; they are counted on the first and
  last stage either way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


class LayoutError(ValueError):
    """A ``parallel.layout`` that cannot be run; the message names the problem and the fix."""


@dataclass(frozen=True)
class StageLayout:
    """``counts[k]``: layers of virtual stage ``k = chunk·stages + stage``."""

    counts: tuple[int, ...]
    stages: int
    chunks: int

    @classmethod
    def even(cls, layers: int, stages: int, chunks: int) -> StageLayout:
        """``layers / (p·v)`` layers per virtual stage (Megatron's default placement)."""
        virtual = stages * chunks
        if layers % virtual:
            raise LayoutError(f"{layers} layers cannot be split evenly over {virtual} virtual stages")
        return cls((layers // virtual,) * virtual, stages, chunks)

    @classmethod
    def parse(cls, spec: Any, layers: int, stages: int, chunks: int) -> StageLayout:
        """``parallel.layout`` (None: even) checked against the model and the mesh."""
        if spec is None:
            return cls.even(layers, stages, chunks)
        counts = _counts(spec)
        virtual = stages * chunks
        if len(counts) != virtual:
            raise LayoutError(
                f"{len(counts)} virtual stages given, parallel.pipe={stages} x parallel.chunks={chunks} needs "
                f"{virtual}; "
                f"give one entry per virtual stage (chunk-major: every stage's chunk 0, then chunk 1, ...)")
        if sum(counts) != layers:
            raise LayoutError(
                f"the layout has {sum(counts)} layers ({' + '.join(map(str, counts))}), the model {layers}; "
                f"make them add up to {layers}")
        if max(counts) == 0:
            raise LayoutError("every virtual stage has 0 layers; give the model's layers to the stages")
        return cls(tuple(counts), stages, chunks)

    @property
    def layers(self) -> int:
        return sum(self.counts)

    @property
    def per_chunk(self) -> int:
        """Layer slots per chunk: the largest count (smaller chunks are padded to it)."""
        return max(self.counts)

    @property
    def is_even(self) -> bool:
        return len(set(self.counts)) == 1

    @property
    def padded_layers(self) -> int:
        """Length of the stage-ordered layer axis: ``p·v·per_chunk``."""
        return self.stages * self.chunks * self.per_chunk

    def stage_order(self) -> np.ndarray:
        """``order[i]``: the canonical layer stored at position ``i`` of the stage-ordered layer axis,
        -1 for a padding slot. Position ``i = s·(v·n) + c·n + j`` (stage ``s``, chunk ``c``, slot ``j``
        of ``n = per_chunk``) holds layer ``start[c·p + s] + j`` when ``j < counts[c·p + s]``."""
        p, v, n = self.stages, self.chunks, self.per_chunk
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        order = np.full((p, v, n), -1, np.int64)
        for s in range(p):
            for c in range(v):
                k = c * p + s
                order[s, c, : self.counts[k]] = starts[k] + np.arange(self.counts[k])
        return order.reshape(-1)

    def describe(self) -> str:
        """``"E t*3 | t*5 L"``-style summary, stage by stage."""
        return " | ".join(f"{'E' if k == 0 else ''}t*{n}{'L' if k == len(self.counts) - 1 else ''}"
                          for k, n in enumerate(self.counts))


def _counts(spec: Any) -> list[int]:
    if isinstance(spec, str) and re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", spec):
        return [int(x) for x in spec.split(",")]
    if isinstance(spec, str):
        return _megatron_counts(spec)
    if isinstance(spec, Sequence) and all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
        if any(x < 0 for x in spec):
            raise LayoutError(f"layer counts must be >= 0, got {list(spec)}")
        return list(spec)
    raise LayoutError(f"expected a list of layer counts per virtual stage (e.g. [3, 5]) or a Megatron-style "
                      f"string (e.g. 'Ettt|tttttL'), got {spec!r}")


_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_SYMBOL = re.compile(r"([EtL])\*(\d+)")


def _megatron_counts(spec: str) -> list[int]:
    text = re.sub(r"\s+", "", spec)
    while True:  # innermost groups first: "(tt|)*2" -> "tt|tt|"
        expanded = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
        if expanded == text:
            break
        text = expanded
    text = _SYMBOL.sub(lambda m: m.group(1) * int(m.group(2)), text)
    bad = sorted(set(text) - set("EtL|"))
    if bad:
        raise LayoutError(f"{spec!r}: unknown symbol(s) {', '.join(map(repr, bad))}; use t (a layer), E (embedding), "
                          "L (loss), | between virtual stages, X*N and (...)*N to repeat")
    stages = text.split("|")
    for k, stage in enumerate(stages):
        if "E" in stage and (k != 0 or stage.index("E") != 0 or stage.count("E") > 1):
            raise LayoutError(f"{spec!r}: E (the embedding) in virtual stage {k}; meshtron embeds on virtual stage 0 "
                              "(stage 0, chunk 0): put one E at the very start")
        if "L" in stage and (k != len(stages) - 1 or not stage.endswith("L") or stage.count("L") > 1):
            raise LayoutError(f"{spec!r}: L (the loss) in virtual stage {k}; meshtron computes the loss after the last "
                              f"virtual stage ({len(stages) - 1}): put one L at the very end")
    return [stage.count("t") for stage in stages]
