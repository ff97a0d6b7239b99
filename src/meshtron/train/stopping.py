"""Stopping a run early and cleanly: SIGTERM/SIGINT (a cluster's preemption notice, Ctrl-C) and
``train.max_minutes`` (Megatron's ``--exit-duration-in-mins``). The training loop asks
:meth:`RunStopper.poll` after every step and, when told to stop, saves that step and raises
:class:`~meshtron.errors.RunStopped` (exit status :data:`~meshtron.errors.EXIT_STOPPED`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

import jax
import numpy as np

from meshtron.errors import EXIT_STOPPED

# Why a run stops early, as a code: the largest wins when processes differ (a signal over the budget).
STOP_REASONS = {1: "max_minutes", 2: "SIGINT", 3: "SIGTERM"}


class RunStopper:
    """Whether the run should stop after the step just done: a SIGTERM/SIGINT arrived, or
    ``train.max_minutes`` (counted from the start of :meth:`Trainer.run`) has passed.

    The handlers, installed for the duration of the run, only record the signal: the step in
    flight (jitted, maybe inside a collective) is never interrupted. A second SIGINT quits at once
    (exit status 130, the checkpoint being written is abandoned: orbax never lists a half-written
    step, so the newest complete one stays usable); a second SIGTERM is ignored (a scheduler that
    repeats it must not cut the checkpoint short; its SIGKILL comes later anyway). A signal that
    is ignored when the run starts (``nohup``, a background job's SIGINT) stays ignored.

    In a multi-process run every process asks after every step and the answers are combined with
    one all-gather of a small integer over the processes, so all of them stop at the same step
    (and save that step together) even when the signal reached them a step apart, or reached
    only some of them; single-process runs add no collective.
    """

    def __init__(self, max_minutes: float | None, *, lead: bool, saving: bool):
        self.start = time.monotonic()
        self.max_minutes = max_minutes
        self.lead, self.saving = lead, saving
        self.received: int | None = None  # the first signal
        self.local = 0  # this process's own stop code at the last poll
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():  # (handlers can be set from it only)
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():  # None: a handler set outside Python (default then)
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = signum
            self._say(f"{name} received: stopping after the step in flight"
                      + (", with a checkpoint" if self.saving else "")
                      + (" (Ctrl-C again quits at once)" if signum == signal.SIGINT else ""))
        elif signum == signal.SIGINT:
            self._say("interrupted again: quitting now without waiting for the checkpoint "
                      "(the newest complete checkpoint is intact)")
            os._exit(130)
        else:
            self._say(f"{name} again: ignored while the run stops (SIGINT quits at once)")

    def _say(self, text: str) -> None:
        if not self.lead:
            return
        line = f"\nmeshtron: {text}\n"
        try:  # os.write: safe wherever the main thread was interrupted (a print may be mid-line)
            os.write(sys.stderr.fileno(), line.encode())
        except (AttributeError, OSError, ValueError):  # a stream without a file descriptor (captured)
            try:
                sys.stderr.write(line)
            except RuntimeError:  # re-entered a write in progress: the note is not worth an error
                pass

    def minutes(self) -> float:
        return (time.monotonic() - self.start) / 60

    def poll(self) -> int:
        """0 to go on, else the stop code (:data:`STOP_REASONS`); in a multi-process run every process
        must call it at the same steps (it is a collective) and all get the same answer."""
        code = 0
        if self.received is not None:
            code = 2 if self.received == signal.SIGINT else 3
        elif self.max_minutes is not None and self.minutes() >= self.max_minutes:
            code = 1
        self.local = code
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            code = int(np.max(multihost_utils.process_allgather(np.int32(code))))
        return code

    def describe(self, step: int, code: int, t, directory: Path | None) -> str:
        """The one line a stopped run prints: why, at which step, where its checkpoint is."""
        reason = STOP_REASONS[code]
        why = (f"train.max_minutes={t.max_minutes:g} reached after {self.minutes():.1f} min" if code == 1
               else f"{reason} received")
        if self.local != code:
            why += " by another process"
        if directory is None:
            where = "no checkpoint written (checkpoint.dir is unset), a new run starts from step 0"
        else:
            where = f"checkpoint {directory}/{step} written; the same command resumes from it"
        return f"meshtron: stopped at step {step} of {t.steps} ({why}): {where} (exit status {EXIT_STOPPED})"
