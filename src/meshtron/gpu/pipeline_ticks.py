"""The tick table of a pipelined run, for the step-time estimate (:mod:`meshtron.gpu.step_time`).

The runtime traces one ``scan`` per segment of ticks (:func:`meshtron.pipeline.runtime.segments`) and,
in every tick of a segment, a slot per kind of work the segment has (forward if any of its ticks runs
one, then a hoisted recomputation, then backward, then weight): a merged segment has slots in ticks where
no stage runs their kind.
This lists those slots in that order, with which stages run each, so the estimate can price every
tick at the branches its stages take (:mod:`meshtron.gpu.slots`) instead of every slot at its
costliest branch. Built from the program alone: nothing is compiled.
"""

from __future__ import annotations

from meshtron.gpu.slots import Slot, TickTable
from meshtron.pipeline.program import Program
from meshtron.pipeline.runtime import segments

__all__ = ["tick_table"]


def tick_table(program: Program) -> TickTable:
    """The slots ``program``'s step traces, tick by tick (``meshtron.run.resolve_run(cfg, devices).program``)."""
    kinds = (("forward", program.fwd_mb), ("recompute", program.pre_mb), ("backward", program.bwd_mb),
             ("weight", program.wgt_mb))
    slots = []
    for segment in segments(program):
        for tick in range(segment.start, segment.stop):
            for kind, microbatches in kinds:
                if getattr(segment, kind):  # the segment's loop has this slot (a weight slot: split backward only)
                    slots.append(Slot(tick, kind, tuple(bool(mb >= 0) for mb in microbatches[tick])))
    return TickTable(tuple(slots))
