"""The examples in the README and the guides run as written."""

import re
from pathlib import Path

import pytest

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
    """Each marked example is executed somewhere in tests/ (an example nobody runs can rot)."""
    names = {m for page in PAGES for m in re.findall(r"<!-- example: (\w+) -->", page.read_text())}
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    assert names and all(f'run_example("{n}")' in tests for n in names), sorted(
        n for n in names if f'run_example("{n}")' not in tests)


@pytest.mark.slow
def test_the_quick_start_trains_checkpoints_and_samples(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace = run_example("quickstart")
    assert namespace["result"].steps == 20 and namespace["pretrained"].step == 20
    assert capsys.readouterr().out.startswith("The with statement")


def test_onebit_lamb_in_a_hand_written_shard_map_step(capsys):
    namespace = run_example("onebit_lamb")
    losses = namespace["losses"]
    assert losses[-1] < 0.3 * losses[0]
    assert namespace["onebit"].compression_stage(len(losses) - 1)  # it did reach the compression stage
    assert "loss" in capsys.readouterr().out
