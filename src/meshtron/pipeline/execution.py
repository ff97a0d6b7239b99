"""How the pipeline runtime executes one schedule: the compiled program and the facts about the run
around it that change how ticks are run.

One value instead of four loose arguments, so that a new way of running ticks is one field here and one
reader in the runtime, not a parameter threaded through every entry point between the trainer and the
tick loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshtron.pipeline.layout import StageLayout
from meshtron.pipeline.program import Program, compile_program
from meshtron.pipeline.schedules import forward_only

__all__ = ["PipelinePlan"]


@dataclass(frozen=True)
class PipelinePlan:
    """``program``: the schedule compiled into the runtime's instructions. ``layout``: the stage layout
    (``None`` or even: every chunk runs the same number of layers; uneven: chunks are padded to the largest
    and skip the padding). ``lockstep``: every stage runs every tick's work, idle or not, and keeps what its
    instruction says -- for stage code whose collectives every device of the mesh must enter at once (a ring
    attention's collective-permutes). ``check_vma``: JAX's varying-manual-axes check, off only when the
    data group has one rank (nothing is reduced over it, so nothing can be re-typed as replicated).

    ``early_sends``: a tick issues each send as soon as what it sends is computed -- the forward's activation
    right after the forward slot, a split backward's input gradient right after B -- and the message it
    receives joins the ordering chain only after the tick's last slot, so the transfer can run under the
    slots in between (the backward's GEMMs, W's). Off, every send follows the tick's last slot and the next
    slot waits for it (:mod:`meshtron.pipeline.runtime`'s deadlock rule). Only for a program whose runtime
    executes every computation's instructions, ``conditional`` s included, one after another in the
    compiled schedule's order, the same on every device -- XLA:GPU's; XLA:CPU runs a ``conditional``
    concurrently with the collectives it does not depend on. The trainer turns it on for a GPU run with
    ``gpu.overlap=on``."""

    program: Program
    layout: StageLayout | None = None
    lockstep: bool = False
    check_vma: bool = True
    early_sends: bool = False

    @property
    def layer_counts(self) -> tuple[int, ...] | None:
        """Layers of each virtual stage when the layout is uneven; ``None`` when every slot is a layer."""
        return None if self.layout is None or self.layout.is_even else self.layout.counts

    @property
    def chunks(self) -> int:
        return self.program.schedule.chunks

    def forward_only(self) -> PipelinePlan:
        """The same stages, microbatches and layer placement run forward only (held-out evaluation)."""
        sched = self.program.schedule
        return replace(self, program=compile_program(forward_only(sched.stages, sched.microbatches, sched.chunks)))
