"""Errors whose message is the whole story (no traceback): the ground floor of the package (it
imports nothing), so every module raises them and the CLI catches them before JAX is imported."""


class ConfigError(ValueError):
    """A configuration value or an argument is wrong; the message names the field and the fix."""


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
