"""Errors whose message is the whole story (no traceback): kept free of JAX so the CLI can catch
them before JAX is imported. ``ConfigError`` (bad configuration) lives in :mod:`meshtron.config`."""


class CheckpointError(ValueError):
    """A checkpoint cannot be used by this run; the message names the checkpoint, the tensor and the fix."""


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/Inf loss or update; the message names the step."""


EXIT_STOPPED = 75  # EX_TEMPFAIL ("try again"): stopped early with a checkpoint; the same command resumes


class RunStopped(Exception):
    """The run stopped early at a step boundary, on SIGTERM/SIGINT or at ``train.max_minutes``, after
    writing a checkpoint of that step (when ``checkpoint.dir`` is set). Not a failure: the message
    (already printed by the trainer) names the reason, the step and the checkpoint; the CLI exits
    with :data:`EXIT_STOPPED`."""

    def __init__(self, message: str, *, step: int, reason: str, checkpoint: str | None):
        super().__init__(message)
        self.step = step  # the last step done (and saved)
        self.reason = reason  # "SIGTERM", "SIGINT" or "max_minutes"
        self.checkpoint = checkpoint  # the checkpoint's directory, None without checkpoint.dir
