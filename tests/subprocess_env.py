"""The environment of the processes tests start (the CLI, scripts, several processes of one run).

Such a process sets its own device count (the CLI adds the flag itself, and tests check that it
does), so the session's ``--xla_force_host_platform_device_count`` is left out; the session's XLA
optimisation level is passed on, so that a run in a subprocess computes with the same machine code
as the in-process run it is compared with bit for bit (see ``conftest.py``).
"""

import os

OPTIMISATION = "--xla_backend_optimization_level=0"

# For a process that runs many more steps than it compiles programs, and is compared with no in-process
# run: LLVM's first level compiles about a quarter slower than level 0 but runs a step two to three times
# faster (the README's quick start, twenty steps of the default model: 38 -> 26 CPU seconds).
RUNNING = "--xla_backend_optimization_level=1"


def subprocess_env(xla_flags: str = "", optimisation: str = OPTIMISATION) -> dict[str, str]:
    """``os.environ`` for a subprocess: its ``XLA_FLAGS`` are the optimisation level and ``xla_flags``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"{optimisation} {xla_flags}".strip()
    return env
