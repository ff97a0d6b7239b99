"""Sizes and counts as people read them: ``1.5 MiB``, ``842.5K`` parameters."""

from __future__ import annotations

__all__ = ["format_bytes", "format_count"]


def format_bytes(nbytes: float) -> str:
    """Binary-prefixed size: ``128 B``, ``1.5 MiB``."""
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        nbytes /= 1024
        if abs(nbytes) < 1024 or unit == "PiB":
            return f"{nbytes:.1f} {unit}"
    raise AssertionError("unreachable")


def format_count(n: float) -> str:
    """Decimal-suffixed count (parameters): ``842.5K``, ``1.0T``."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))
