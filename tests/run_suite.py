"""Run the test suite (or a marker-selected tier of it) the way ``make test`` does.

Where the jaxlib has XLA:CPU's switch between emitters (jaxlib 0.10; 0.12 has only the fusion emitters),
the suite runs in two pytest sessions:

1. every test not marked ``fusion_emitters``, compiled with XLA:CPU's element-wise IR emitters
   (``MESHTRON_TEST_EMITTERS=elemental``, read by ``subprocess_env``): the choice is how a fusion becomes
   LLVM IR, after XLA's HLO passes -- the same program, collectives and buffer sizes -- and these emitters
   compile the tests' programs in two thirds to three quarters of the CPU time (docs/testing.md);
2. the tests marked ``fusion_emitters``, with XLA's defaults: they hold two different programs equal bit
   for bit (or to a few ulps), which the default emitters do and the element-wise ones, rounding fused
   work differently, do not.

Elsewhere it is one session with XLA's defaults. A plain ``pytest`` run always keeps XLA's defaults.

Usage: ``python tests/run_suite.py MARKERS [PYTEST ARGUMENTS...]``, MARKERS a pytest marker expression
(empty: the whole suite). A ``--junitxml=PATH`` argument names the first session's report; the second
session's goes to ``PATH`` with ``.fusion-emitters`` before its suffix. Exits non-zero if a session fails
or if neither collected a test (pytest's exit code 5 is a failure here, not a pass).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from subprocess_env import has_emitter_switch

ROOT = Path(__file__).resolve().parents[1]
NO_TESTS = 5  # pytest's exit code when a session collects no tests


def narrowed(markers: str, extra: str) -> str:
    return f"({extra}) and ({markers})" if markers.strip() else extra


def second_report(arguments: list[str]) -> list[str]:
    """The arguments with a ``--junitxml`` report path moved aside for the second session."""
    out = []
    for argument in arguments:
        if argument.startswith("--junitxml="):
            path = Path(argument.partition("=")[2])
            argument = f"--junitxml={path.with_name(path.stem + '.fusion-emitters' + path.suffix)}"
        out.append(argument)
    return out


def pytest(arguments: list[str], markers: str, env: dict[str, str] | None = None) -> int:
    """One pytest session over ``arguments`` narrowed to ``markers``; its exit code."""
    command = [sys.executable, "-m", "pytest", "-q", *([] if not markers else ["-m", markers]), *arguments]
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, cwd=ROOT, env=env, check=False).returncode


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python tests/run_suite.py MARKERS [PYTEST ARGUMENTS...]", file=sys.stderr)
        return 2
    markers, arguments = argv[0], argv[1:]
    if not has_emitter_switch():
        codes = [pytest(arguments, markers)]
    else:
        defaults = {k: v for k, v in os.environ.items() if k != "MESHTRON_TEST_EMITTERS"}
        codes = [pytest(arguments, narrowed(markers, "not fusion_emitters"), {**defaults, "MESHTRON_TEST_EMITTERS": "elemental"}),
                 pytest(second_report(arguments), narrowed(markers, "fusion_emitters"), defaults)]
    if all(code == NO_TESTS for code in codes):
        print("run_suite: pytest collected no tests", file=sys.stderr)
        return 1
    failed = [code for code in codes if code not in (0, NO_TESTS)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
