"""The examples in the README and the guides run as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import RUNNING, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def example(name: str) -> str:
    """The ```python block that follows ``<!-- example: name -->`` in the README or a guide in docs/."""
    for page in PAGES:
        match = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", page.read_text(), re.DOTALL)
        if match:
            return match.group(1)
    raise AssertionError(f"no page has the example {name!r}")


def run_example(name: str) -> dict:
    """Run the example ``name`` as written; its global names afterwards."""
    namespace: dict = {}
    exec(compile(example(name), f"{name} example", "exec"), namespace)  # noqa: S102 (the docs' own code)
    return namespace


def test_every_example_is_run_by_a_test():
    """Each marked example is executed somewhere in tests/ (``run_example``, or ``example`` in a fresh process):
    an example nobody runs can rot."""
    names = {m for page in PAGES for m in re.findall(r"<!-- example: (\w+) -->", page.read_text())}
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    assert names and all(f'example("{n}")' in tests for n in names), sorted(
        n for n in names if f'example("{n}")' not in tests)


@pytest.mark.slow
def test_the_quick_start_trains_checkpoints_and_samples(tmp_path):
    """Verbatim, in a fresh interpreter on a plain CPU machine: no simulated-device flags (the session's
    eight devices are not passed on), so the example gets the devices its mesh needs by itself."""
    script = tmp_path / "quickstart.py"
    script.write_text(example("quickstart") + "\nprint('steps', result.steps, pretrained.step)\n")
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, env=subprocess_env(optimisation=RUNNING),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The with statement") and done.stdout.rstrip().endswith("steps 20 20")
    assert "xla_force_host_platform_device_count" not in subprocess_env()["XLA_FLAGS"]


def test_onebit_lamb_in_a_hand_written_shard_map_step(capsys):
    namespace = run_example("onebit_lamb")
    losses = namespace["losses"]
    assert losses[-1] < 0.3 * losses[0]
    assert namespace["onebit"].compression_stage(len(losses) - 1)  # it did reach the compression stage
    assert "loss" in capsys.readouterr().out
