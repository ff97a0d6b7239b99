"""The README's code examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def example(name: str) -> str:
    """The ```python block that follows ``<!-- example: name -->`` in the README."""
    match = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert match, f"README has no example {name!r}"
    return match.group(1)


def run_example(name: str) -> dict:
    """Run the README's example ``name`` as written; its global names afterwards."""
    namespace: dict = {}
    exec(compile(example(name), f"README.md ({name} example)", "exec"), namespace)  # noqa: S102 (the README's own code)
    return namespace


def test_onebit_lamb_in_a_hand_written_shard_map_step(capsys):
    namespace = run_example("onebit_lamb")
    losses = namespace["losses"]
    assert losses[-1] < 0.3 * losses[0]
    assert namespace["onebit"].compression_stage(len(losses) - 1)  # it did reach the compression stage
    assert "loss" in capsys.readouterr().out
