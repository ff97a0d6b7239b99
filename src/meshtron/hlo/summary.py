"""One compiled step summed up per device: its collectives by kind and mesh axes, its FLOPs and its
memory, as ``describe`` and the benchmarks print them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshtron.hlo.collectives import Collective, MeshOrSizes, bytes_by_axes, collectives
from meshtron.units import format_bytes

if TYPE_CHECKING:
    import jax

__all__ = ["MemoryFigures", "StepAnalysis", "analyze", "memory_figures"]


@dataclass(frozen=True)
class MemoryFigures:
    """Per-device buffer sizes XLA reports for a compiled program."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    temp_size_in_bytes: int
    alias_size_in_bytes: int

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs + temporaries, not counting outputs that alias (donated) inputs."""
        return (
            self.argument_size_in_bytes
            + self.output_size_in_bytes
            + self.temp_size_in_bytes
            - self.alias_size_in_bytes
        )


@dataclass(frozen=True)
class StepAnalysis:
    """Communication, compute and memory of one compiled step, per device."""

    collectives: tuple[Collective, ...]
    flops: float | None
    memory: MemoryFigures | None

    def bytes_by_axes(self) -> dict[tuple[str, ...], int]:
        return bytes_by_axes(self.collectives)

    def table(self) -> str:
        """Collectives grouped by (kind, axes, dtype): instructions, executions and bytes per step."""
        groups: dict[tuple[str, tuple[str, ...], str], list[Collective]] = defaultdict(list)
        for collective in self.collectives:
            groups[(collective.kind, collective.axes, collective.dtype)].append(collective)
        header = ("kind", "axes", "dtype", "ops", "count", "bytes", "wire bytes")
        rows = [
            (
                kind,
                ",".join(axes) or "-",
                dtype,
                str(len(members)),
                str(sum(c.count for c in members))
                + ("?" if any(c.unknown_trip_count for c in members) else ""),
                format_bytes(sum(c.total_bytes for c in members)),
                format_bytes(sum(c.total_wire_bytes for c in members)),
            )
            for (kind, axes, dtype), members in sorted(
                groups.items(), key=lambda item: -sum(c.total_bytes for c in item[1])
            )
        ]
        rows.append((
            "total", "", "", str(len(self.collectives)),
            str(sum(c.count for c in self.collectives)),
            format_bytes(sum(c.total_bytes for c in self.collectives)),
            format_bytes(sum(c.total_wire_bytes for c in self.collectives)),
        ))  # fmt: skip
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        numeric = {3, 4, 5, 6}

        def render(row: Sequence[str]) -> str:
            cells = (
                cell.rjust(w) if i in numeric else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
            return "  ".join(cells).rstrip()

        rule = "  ".join("-" * w for w in widths)
        lines = [render(header), rule, *(render(row) for row in rows[:-1]), rule, render(rows[-1])]
        if self.flops is not None:
            lines.append(f"flops: {self.flops:.4g}")
        if self.memory is not None:
            m = self.memory
            lines.append(
                f"memory: arguments {format_bytes(m.argument_size_in_bytes)}, outputs "
                f"{format_bytes(m.output_size_in_bytes)}, temporaries {format_bytes(m.temp_size_in_bytes)}, "
                f"aliased {format_bytes(m.alias_size_in_bytes)}"
            )
        return "\n".join(lines)


def analyze(compiled: jax.stages.Compiled, mesh: MeshOrSizes) -> StepAnalysis:
    """Collectives, FLOPs and memory of a compiled program. FLOPs or memory are ``None`` when the
    backend does not report them."""
    return StepAnalysis(
        collectives=tuple(collectives(compiled, mesh)),
        flops=_flops(compiled),
        memory=memory_figures(compiled),
    )


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - backends without a cost model raise various errors
        return None
    if isinstance(cost, Sequence) and not isinstance(cost, Mapping):  # older JAX: one dict per module
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def memory_figures(compiled: Any) -> MemoryFigures | None:
    """The per-device buffer sizes of a compiled program; ``None`` when the backend does not report them."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if stats is None:
        return None
    return MemoryFigures(
        argument_size_in_bytes=int(stats.argument_size_in_bytes),
        output_size_in_bytes=int(stats.output_size_in_bytes),
        temp_size_in_bytes=int(stats.temp_size_in_bytes),
        alias_size_in_bytes=int(stats.alias_size_in_bytes),
    )
