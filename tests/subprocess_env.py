"""The environment of the processes tests start (the CLI, scripts, several processes of one run).

Such a process sets its own device count (the CLI adds the flag itself, and tests check that it
does), so the session's ``--xla_force_host_platform_device_count`` is left out; the session's XLA
code-generation flags (optimisation level and emitters) are passed on, so that a run in a subprocess
computes with the same machine code as the in-process run it is compared with bit for bit (see
``conftest.py``).
"""

import os
from importlib.metadata import PackageNotFoundError, version


def has_emitter_switch() -> bool:
    """jaxlib 0.10's XLA has ``--xla_cpu_use_fusion_emitters``; 0.12's has only the fusion emitters, and
    an unknown flag in ``XLA_FLAGS`` aborts the process."""
    try:
        major, minor = (int(part) for part in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (0, 11)


def _emitters() -> str:
    """XLA:CPU's element-wise IR emitters instead of its MLIR fusion emitters, in the session
    ``tests/run_suite.py`` starts with ``MESHTRON_TEST_EMITTERS=elemental`` where the jaxlib has the
    switch. The choice is how a fusion becomes LLVM IR, after XLA's HLO passes
    (the same collectives and buffer sizes; the fusion emitters only wrap lone instructions as fusions
    of one), and the element-wise emitters compile faster; they round fused work differently, so the
    tests marked ``fusion_emitters`` run in a session of their own with XLA's defaults."""
    elemental = os.environ.get("MESHTRON_TEST_EMITTERS") == "elemental" and has_emitter_switch()
    return "--xla_cpu_use_fusion_emitters=false" if elemental else ""


EMITTERS = _emitters()
OPTIMISATION = f"--xla_backend_optimization_level=0 {EMITTERS}".strip()

# For a process that runs many more steps than it compiles programs, and is compared with no in-process
# run: LLVM's first level compiles about a quarter slower than level 0 but runs a step two to three times
# faster (the README's quick start, twenty steps of the default model: 38 -> 26 CPU seconds).
RUNNING = f"--xla_backend_optimization_level=1 {EMITTERS}".strip()


def subprocess_env(xla_flags: str = "", optimisation: str = OPTIMISATION) -> dict[str, str]:
    """``os.environ`` for a subprocess: its ``XLA_FLAGS`` are the optimisation level and ``xla_flags``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"{optimisation} {xla_flags}".strip()
    return env
