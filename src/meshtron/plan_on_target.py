"""``meshtron plan --target h100``: the planner's best layouts compiled for the GPUs and priced from
their programs.

The planner's analytical time model ranks thousands of layouts in a second. For the few at the top,
a better figure exists: meshtron's own step compiled for the target's GPUs (no GPU needed,
:mod:`meshtron.gpu.targets`), priced by :mod:`meshtron.gpu.step_time` from the scheduled program.
That figure sees what the analytical model cannot: XLA's fusions, the collectives the scheduler hid,
cuDNN's attention. Each row says which model priced it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from meshtron.config import Config, load_config
from meshtron.gpu.targets import MAX_DEVICES
from meshtron.plan.model import Layout


@dataclass(frozen=True)
class PricedLayout:
    """One ranked layout, as the analytical model and (when it compiled) the GPU program price it."""

    rank: int
    layout: Layout
    analytical_seconds: float
    program_seconds: float | None  # None: not compiled (``why``)
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    hidden_fraction: float | None
    compile_seconds: float | None
    why: str = ""

    @property
    def priced_by(self) -> str:
        return "gpu program" if self.program_seconds is not None else "analytical"


def layout_overrides(layout: Layout, zero: int) -> list[str]:
    """The config settings that run ``layout`` (the planner's t, p, d, v, b and recomputation)."""
    return [f"parallel.tensor={layout.tensor}", f"parallel.pipe={layout.pipe}", f"parallel.data={layout.data}",
            f"parallel.context={layout.context}", f"parallel.chunks={layout.chunks}",
            f"parallel.microbatches={layout.microbatches}", f"train.batch_size={layout.global_batch}",
            f"parallel.schedule={'interleaved' if layout.chunks > 1 else '1f1b'}", f"model.remat={layout.recompute}",
            f"parallel.sequence_parallel={'true' if layout.sequence_parallel else 'false'}",
            f"parallel.zero={zero if layout.data > 1 else 0}"]


def price_on_target(config: str, overrides: list[str], ranked: list, target: str, zero: int) -> list[PricedLayout]:
    """Compile each of ``ranked`` (the planner's :class:`~meshtron.plan.timing.Estimate`\\ s, best first)
    for ``target`` and price its program; a layout that cannot be built or compiled keeps its analytical
    figure and says why, in one line."""
    from meshtron.errors import ConfigError
    from meshtron.gpu.pipeline_ticks import tick_table
    from meshtron.gpu.step_time import estimate_step, model_flops
    from meshtron.train.loop import Trainer

    priced = []
    for rank, estimate in enumerate(ranked, 1):
        layout = estimate.layout
        row = {"rank": rank, "layout": layout, "analytical_seconds": estimate.step_seconds, "program_seconds": None,
               "tokens_per_s_per_gpu": None, "mfu": None, "hidden_fraction": None, "compile_seconds": None}
        if layout.gpus > MAX_DEVICES:
            priced.append(PricedLayout(**row, why=f"{layout.gpus} GPUs: more than the {MAX_DEVICES} a target compiles for"))
            continue
        try:
            cfg: Config = load_config(config, [*overrides, *layout_overrides(layout, zero)])
            started = time.perf_counter()
            trainer = Trainer.from_config(cfg, target=target, read_data=False)
            program = trainer.steps.compile(*trainer.abstract_step_arguments(), trainer.steps.stages[0])
            row["compile_seconds"] = time.perf_counter() - started
        except ConfigError as err:
            priced.append(PricedLayout(**row, why=str(err)))
            continue
        m = cfg.model
        tokens = layout.global_batch * m.seq_len
        params = sum(leaf.size for leaf in _leaves(trainer.model_def.shapes()))
        flops, attention = model_flops(params=params, layers=trainer.model_def.layers, hidden=m.hidden,
                                       seq_len=m.seq_len, tokens=tokens)
        pipelined = trainer.resolved.program
        step = estimate_step(program, trainer.mesh, target, tokens_per_step=tokens, model_flops_per_step=flops,
                             causal_attention_flops_per_step=attention,
                             ticks=tick_table(pipelined) if pipelined is not None else None)
        row.update(program_seconds=step.seconds, tokens_per_s_per_gpu=step.tokens_per_s_per_gpu, mfu=step.mfu,
                   hidden_fraction=step.hidden_fraction)
        priced.append(PricedLayout(**row))
    return priced


def priced_json(priced: list[PricedLayout]) -> list[dict]:
    """The priced rows as JSON-ready values."""
    return [{"rank": p.rank, "tensor": p.layout.tensor, "pipe": p.layout.pipe, "data": p.layout.data,
             "chunks": p.layout.chunks, "microbatches": p.layout.microbatches, "recompute": p.layout.recompute,
             "analytical_step_seconds": p.analytical_seconds, "program_step_seconds": p.program_seconds,
             "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "mfu": p.mfu, "hidden_fraction": p.hidden_fraction,
             "compile_seconds": p.compile_seconds, "priced_by": p.priced_by, "why": p.why} for p in priced]


def _leaves(tree) -> list:
    import jax

    return jax.tree.leaves(tree)


def render_priced(priced: list[PricedLayout], target: str) -> str:
    """The table ``meshtron plan --target`` adds under the ranking."""
    lines = [(f"\nthe top {len(priced)} compiled for {target} (meshtron's step, XLA:GPU, no GPU needed) and priced "
              "from the program (meshtron.gpu.step_time; docs/gpu.md)")]
    header = ("#", "t", "p", "d", "v", "m", "recompute", "analytical step s", "GPU-program step s", "tokens/s/GPU",
              "MFU", "hidden", "compile s", "priced by")
    rows = []
    for p in priced:
        lay = p.layout
        compiled = p.program_seconds is not None
        rows.append((p.rank, lay.tensor, lay.pipe, lay.data, lay.chunks, lay.microbatches, lay.recompute,
                     f"{p.analytical_seconds:.3g}", f"{p.program_seconds:.3g}" if compiled else "-",
                     f"{p.tokens_per_s_per_gpu:,.0f}" if compiled else "-", f"{p.mfu:.1%}" if compiled else "-",
                     f"{p.hidden_fraction:.0%}" if compiled else "-",
                     f"{p.compile_seconds:.0f}" if p.compile_seconds is not None else "-",
                     p.priced_by if compiled else f"analytical ({p.why})"))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines.append("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in rows]
    lines.append("pipelined rows price each tick at the pipeline slots its slowest stage runs (docs/gpu.md)")
    return "\n".join(lines)
