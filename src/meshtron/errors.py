"""Errors whose message is the whole story (no traceback): kept free of JAX so the CLI can catch
them before JAX is imported. ``ConfigError`` (bad configuration) lives in :mod:`meshtron.config`."""


class CheckpointError(ValueError):
    """A checkpoint cannot be used by this run; the message names the checkpoint, the tensor and the fix."""


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/Inf loss or update; the message names the step."""
