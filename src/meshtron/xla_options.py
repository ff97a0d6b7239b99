"""The XLA compiler options a run compiles every program with: ``gpu.overlap`` and ``gpu.xla_flags``.

XLA reads the ``XLA_FLAGS`` environment variable once, when JAX's backend starts, so a flag set there
depends on when (and whether) the process set it. A *compiler option* sets the same XLA
``DebugOptions`` field by name for one program (``jax.jit(..., compiler_options=...)``), whenever it
is compiled: ``meshtron describe --compile --target h100`` on this machine and ``meshtron train`` on a
pod then hand XLA the same options, and so get the same program. XLA:CPU accepts the GPU fields and
ignores them, so the options travel with every config.

``gpu.overlap=on`` is a bundle chosen by measurement on the compiled Llama-2 7B steps (docs/gpu.md,
"XLA flags and the schedule"); ``gpu.xla_flags`` is an expert's list in ``XLA_FLAGS`` syntax, applied
on top (a field it names wins over the bundle's).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

from meshtron.errors import ConfigError

__all__ = ["OVERLAP_MODES", "OVERLAP_ON", "OptionValue", "as_flags", "compiler_options", "for_this_xla",
           "parse_xla_flags", "run_options"]

OptionValue = bool | int | float | str

OVERLAP_MODES = ("off", "on")

# What ``gpu.overlap=on`` sets, measured on Llama-2 7B's steps for 64 H100s (benchmarks/overlap_flags.py).
# The collective pipeliner moves a loop's all-reduces -- among them those XLA:GPU later turns into
# sequence parallelism's reduce-scatters -- into the neighbouring iteration, under another layer's
# GEMMs (tensor axis of data 8 x tensor 8: 30.7% -> 38.1% hidden, step -2.1%). Left out, each for a
# measured reason (docs/gpu.md): pipelined p2p (``--xla_gpu_enable_pipelined_p2p=true`` with
# ``--xla_gpu_collective_permute_decomposer_threshold=0``) hides the pipeline runtime's permutes behind
# small fusions but not the step (pipe axis of 8 x 4 x 2: 2.9% -> 25.2% hidden, step the same within
# 0.1%), and jaxlib 0.12's XLA aborts on it (``p2p_schedule_preparation.cc: kind == kPipelined``) for
# the interleaved and zb-h1 schedules and for 1F1B with cuDNN attention or FP8 projections; the
# pipeliner's all-gather and reduce-scatter switches, loop double buffering, two collectives in flight
# and windowed einsum changed nothing, crashed XLA, or slowed one of the steps.
# ``gpu.overlap=on`` also makes the pipeline runtime send early on GPUs, which is not a compiler option
# (:meth:`meshtron.run.Run.pipeline_on`): pipe axis of 8 x 4 x 2 2.9% -> 83.2% hidden, under the stages' GEMMs.
OVERLAP_ON: dict[str, OptionValue] = {"xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_ON"}

# XLA_FLAGS spellings that are not DebugOptions fields: XLA's flag parser maps them onto a field, and a
# compiler option must name the field. The collective pipeliner's switches are an enum, whose values
# XLA_FLAGS also writes in short.
_PIPELINING = {"xla_gpu_enable_pipelined_all_gather": "xla_gpu_pipeline_all_gather",
               "xla_gpu_enable_pipelined_reduce_scatter": "xla_gpu_pipeline_reduce_scatter",
               "xla_gpu_enable_pipelined_all_reduce": "xla_gpu_pipeline_all_reduce"}
_PIPELINING_MODES = ("default", "off", "on", "explicit")
_NAME = re.compile(r"^xla_[a-z0-9_]+$")
_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


def _typed(text: str) -> OptionValue:
    """An ``XLA_FLAGS`` value as the option type XLA's field takes: bool, int, float, else text (enum
    names such as ``WHILE_LOOP_UNROLLING_DOUBLE_BUFFER``, lists such as ``ALLREDUCE,ALLGATHER``)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text


def parse_xla_flags(text: str, field: str = "gpu.xla_flags") -> dict[str, OptionValue]:
    """``--name=value ...`` (``XLA_FLAGS`` syntax; a bare ``--name`` is ``true``) as typed compiler
    options. Anything else is one ConfigError line naming ``field``."""
    options: dict[str, OptionValue] = {}
    for token in text.split():
        name, has_value, value = token.removeprefix("--").partition("=")
        if not token.startswith("--") or not _NAME.match(name) or (has_value and not value):
            raise ConfigError(f"{field}: {token!r} is not an XLA flag; write flags as in XLA_FLAGS, "
                              "e.g. '--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_p2p=true'")
        options.update([_as_field(name, _typed(value) if has_value else True)])
    return options


def _as_field(name: str, value: OptionValue) -> tuple[str, OptionValue]:
    """A flag as the DebugOptions field it sets: the collective pipeliner's boolean spellings
    (``--xla_gpu_enable_pipelined_all_gather=true``) and short modes (``--xla_gpu_pipeline_all_gather=on``)
    as ``xla_gpu_pipeline_*`` = ``COLLECTIVE_PIPELINING_MODE_*``."""
    if name in _PIPELINING and isinstance(value, bool):
        return _PIPELINING[name], f"COLLECTIVE_PIPELINING_MODE_{'ON' if value else 'DEFAULT'}"
    if name in _PIPELINING.values() and str(value).lower() in _PIPELINING_MODES:
        return name, f"COLLECTIVE_PIPELINING_MODE_{str(value).upper()}"
    return name, value


def compiler_options(overlap: str = "off", xla_flags: str | None = None) -> dict[str, OptionValue]:
    """The options every program of a run is compiled with: the ``overlap`` bundle, then ``xla_flags``
    (a field both name takes ``xla_flags``' value)."""
    if overlap not in OVERLAP_MODES:
        raise ConfigError(f"gpu.overlap: must be one of {', '.join(OVERLAP_MODES)}, got {overlap!r}")
    options = dict(OVERLAP_ON) if overlap == "on" else {}
    options.update(parse_xla_flags(xla_flags) if xla_flags else {})
    return options


def run_options(overlap: str = "off", xla_flags: str | None = None) -> dict[str, OptionValue]:
    """:func:`compiler_options` as this process's XLA takes them (:func:`for_this_xla`): what a run's
    programs are compiled with."""
    return for_this_xla(compiler_options(overlap, xla_flags))


def for_this_xla(options: Mapping[str, OptionValue]) -> dict[str, OptionValue]:
    """``options`` as the XLA of the installed jaxlib names them. Each is tried on a tiny program (once
    per process); XLA renamed the collective pipeliner's switches (``xla_gpu_enable_pipelined_*``, a
    boolean, became ``xla_gpu_pipeline_*``, an enum), so one XLA does not know gets the other spelling;
    an option neither knows is one ConfigError line (XLA would reject it at the first compile)."""
    usable: dict[str, OptionValue] = {}
    for name, value in options.items():
        for candidate in ((name, value), _other_spelling(name, value)):
            if candidate is not None and _known(*candidate):
                usable[candidate[0]] = candidate[1]
                break
        else:
            import jax

            raise ConfigError(f"gpu.xla_flags: the XLA of jax {jax.__version__} has no option {name}={value}; "
                              "check the name against its DebugOptions (`strings` on the jaxlib or CUDA plugin library)")
    return usable


def _other_spelling(name: str, value: OptionValue) -> tuple[str, OptionValue] | None:
    """The collective pipeliner's switch in the other XLA's spelling (enum field <-> boolean flag)."""
    older = {field: flag for flag, field in _PIPELINING.items()}
    if name in older and isinstance(value, str):
        return older[name], value == "COLLECTIVE_PIPELINING_MODE_ON"
    if name in _PIPELINING and isinstance(value, bool):
        return _PIPELINING[name], f"COLLECTIVE_PIPELINING_MODE_{'ON' if value else 'DEFAULT'}"
    return None


@functools.cache
def _known(name: str, value: OptionValue) -> bool:
    """Whether this process's XLA compiles a program with option ``name`` set to ``value``."""
    import jax
    import jax.numpy as jnp

    try:
        jax.jit(lambda: jnp.zeros(()), compiler_options={name: value}).lower().compile()
    except Exception as err:  # XLA reports an unknown option, or a value its field cannot take, at compile time
        if "compile option" in str(err) or "While setting option" in str(err):
            return False
        raise
    return True


def as_flags(options: Mapping[str, OptionValue]) -> str:
    """Options written back as ``XLA_FLAGS`` (what ``describe`` prints; empty for none)."""
    def text(value: OptionValue) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return " ".join(f"--{name}={text(value)}" for name, value in options.items())
