"""matplotlib for the library's drawings (schedule timelines, loss curves): headless, optional.

matplotlib is in the ``bench`` extra, not a dependency: a command that draws says how to get it in
one line instead of failing on import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshtron.errors import ConfigError


def pyplot(what: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed); ``what`` names the drawing
    for the error when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"{what} needs matplotlib: pip install 'meshtron[bench]'") from None
    return plt


def save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (folders made as needed) and free it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
