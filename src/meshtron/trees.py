"""Names for pytree leaves, as checkpoints, checksums and error messages show them."""

from __future__ import annotations

from typing import Any

import jax


def leaf_names(tree: Any) -> list[str]:
    """Dotted names of ``tree``'s leaves in flattening order (``opt_state.optimizer.0.mu.wte``)."""
    return [jax.tree_util.keystr(path, simple=True, separator=".")
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
