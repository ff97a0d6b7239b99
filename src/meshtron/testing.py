"""A parity oracle for any model: its loss and every gradient on parallel layouts equal one device's.

The check a user runs before trusting a new model (or a new rule in the rules table) on a big
mesh. For each layout it builds exactly the program training runs -- the data-parallel
``shard_map``, the tensor split from the model's logical axes, the pipeline schedule over ``pipe``
with layers in stage order -- computes the mean loss and the data-parallel-reduced gradients of one
batch, brings the gradients back to canonical layer order, and compares them with the single-device
result, leaf by leaf::

    from meshtron.testing import check_parity

    reports = check_parity(lambda rngs: MyLM(rngs=rngs), [(1, 1, 8), (2, 2, 2, "interleaved", 2)],
                           rules={"ffn": "tensor"}, seq_len=32)

Each layout is ``(data, pipe, tensor)`` or ``(data, pipe, tensor, schedule, chunks)``, or a
:class:`Layout` (which also splits sequences over context ranks: ``Layout(2, 1, 2, context=2)``). A mismatch raises :class:`ParityError` naming the layout, the parameter and the
numbers, and so does a layout whose program fails to build or run, in one line naming the layout and the
error (``raise_on_mismatch=False`` returns the reports instead, that layout's with its ``error``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import jax
import numpy as np
import optax

from meshtron.config import Config, MeshConfig, ModelConfig, PipelineConfig, TrainConfig
from meshtron.errors import ConfigError
from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.mesh import build_mesh
from meshtron.models.contract import ModelFactory
from meshtron.optim import data_parallel_mean
from meshtron.run import Run, resolve_run
from meshtron.sharding import MEGATRON_RULES, extend_rules
from meshtron.train.pipelined import to_canonical, to_stage_order
from meshtron.train.state import ModelDef, Params
from meshtron.train.step import build_steps
from meshtron.trees import leaf_names


class ParityError(AssertionError):
    """A layout's loss or gradients differ from the single-device run."""


@dataclass(frozen=True)
class Layout:
    """A mesh and, with ``pipe > 1``, the pipeline schedule (``chunks`` = v for interleaved;
    ``recompute=False``: the forward keeps the layers' residuals, ``parallel.recompute=false``;
    ``layer_layout``: an uneven ``parallel.layout``, counts per virtual stage or a Megatron string;
    ``context``: ranks each sequence is split over, their attention exchanging keys and values as
    ``context_attention`` says, ``parallel.context_attention``, the hybrid's all-to-alls over
    ``ulysses_degree`` of them)."""

    data: int
    pipe: int
    tensor: int
    schedule: str = "1f1b"
    chunks: int = 1
    microbatches: int | None = None  # default: 2·pipe with a pipeline (enough to fill it), else 1
    recompute: bool = True
    layer_layout: tuple[int, ...] | str | None = None
    context: int = 1
    context_attention: str = "gathered"
    ulysses_degree: int = 1

    @classmethod
    def of(cls, spec: Layout | Sequence) -> Layout:
        return spec if isinstance(spec, Layout) else cls(*spec)

    def __str__(self) -> str:
        mesh = f"{self.data}x{self.pipe}x{self.tensor}"
        if self.context > 1:
            mesh += f" context={self.context} {self.context_attention}"
            if self.context_attention == "hybrid":
                mesh += f" u={self.ulysses_degree}"
        kept = "" if self.recompute else " no-recompute"
        uneven = "" if self.layer_layout is None else f" layout={self.layer_layout}"
        return mesh if self.pipe == 1 else f"{mesh} {self.schedule} v={self.chunks} m={self.m}{kept}{uneven}"

    @property
    def devices(self) -> int:
        return self.data * self.pipe * self.tensor * self.context

    @property
    def m(self) -> int:
        return self.microbatches or (2 * self.pipe if self.pipe > 1 else 1)


@dataclass(frozen=True)
class ParityReport:
    """One layout against the single-device run: losses, and the largest gradient difference; or, for a
    layout whose program failed to build or run, ``error`` (NaN numbers, not ``ok``)."""

    layout: Layout
    loss: float
    reference_loss: float
    worst_parameter: str
    worst_abs_diff: float
    ok: bool
    error: str = ""


def _resolved(md: ModelDef, layout: Layout, batch: int, seq_len: int) -> Run:
    """``layout`` as a run of this model (its stage layout, schedule and program), checked as a
    config's would be (a layout that cannot work is one line naming the setting)."""
    cfg = Config(
        mesh=MeshConfig(layout.data, layout.pipe, layout.tensor, layout.context),
        model=ModelConfig(factory="meshtron.testing:check_parity", layers=md.layers, seq_len=seq_len,
                          context_attention=layout.context_attention, ulysses_degree=layout.ulysses_degree),
        train=TrainConfig(batch_size=batch, microbatches=layout.m),
        pipeline=PipelineConfig(schedule=layout.schedule, chunks=layout.chunks, recompute=layout.recompute,
                                layout=None if layout.layer_layout is None else layout.layer_layout),
    )
    return resolve_run(cfg, layout.devices)


def _gradients(md: ModelDef, layout: Layout, params: Params, tokens: np.ndarray, devices,
               execution: Execution) -> tuple[float, Params]:
    """Loss and canonical-order gradients of ``tokens`` on ``layout`` (parameters given canonical), the
    model executed as ``execution`` says with the layout's own exchange over a split sequence."""
    mesh = build_mesh(MeshConfig(layout.data, layout.pipe, layout.tensor, layout.context), devices[:layout.devices])
    run = _resolved(md, layout, tokens.shape[0], tokens.shape[1] - 1)
    execution = replace(execution, context_attention=layout.context_attention, ulysses_degree=layout.ulysses_degree)
    program, stages = run.program, run.stage_layout
    md.check_mesh(mesh, stages.padded_layers if stages is not None else None)
    steps = build_steps(md, mesh, data_parallel_mean(), optax.sgd(0.0), microbatches=layout.m, pipeline=run.pipeline,
                        execution=execution)
    if program is not None:  # training keeps block layers in stage order (meshtron.train.pipelined)
        params = jax.device_get(to_stage_order(params, md.layers, layout.pipe, layout.chunks, stages))
    placed = jax.device_put(params, steps.param_shardings)
    loss, grads = steps.gradients(placed, jax.device_put(tokens, steps.batch_sharding))
    if program is not None:
        grads = to_canonical(grads, md.layers, layout.pipe, layout.chunks, stages)
    return float(loss), jax.device_get(grads)


def _failure(layout: Layout, error: Exception) -> str:
    """One line for a layout whose program failed: the layout, the exception's type and first line."""
    lines = str(error).strip().splitlines()
    return f"{layout}: failed to run: {type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def check_parity(
    model: ModelFactory | ModelDef,
    layouts: Sequence[Layout | Sequence],
    *,
    rules: Mapping[str, str | None] | None = None,
    seq_len: int = 16,
    batch: int | None = None,
    seed: int = 0,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    loss_rtol: float = 1e-5,
    norm_rtol: float | None = None,
    raise_on_mismatch: bool = True,
    devices=None,
    grouped_loss: bool = False,
    documents: bool = False,
    execution: Execution = DEFAULT_EXECUTION,
) -> list[ParityReport]:
    """Compare the loss and gradients of one random batch on each of ``layouts`` with one device.

    The single-device run sees the whole batch at once, so a model that mixes rows of the batch is
    caught on a data-parallel layout. With ``grouped_loss`` it averages instead over the groups of rows
    the layout splits the batch into (data shards times microbatches): for a model whose loss depends
    on the group it sees by design (the load balance of a mixture of experts, computed per
    microbatch as Megatron and MaxText do).

    With ``documents`` the batch is windows of packed documents (:func:`packed_windows`: random
    document lengths, loss masks with holes, padding at the end of some rows): a model whose
    positions or attention ignore the documents, or a layout that mixes them up, fails.

    ``model`` is a factory ``rngs -> model`` (with ``rules`` added to Megatron's table) or a
    :class:`ModelDef`. ``execution``: how the model runs, alike on one device and on every layout
    (``model.remat``, ``model.attention``: :class:`~meshtron.execution.Execution`); each layout's
    ``context_attention`` is its exchange. ``batch`` must be divisible by every layout's data size times
    its microbatches.
    Gradients match when ``|g - g_ref| <= atol + rtol·|g_ref|`` everywhere; with ``norm_rtol``, when
    each parameter's ``||g - g_ref|| <= norm_rtol·||g_ref||`` instead (for low-precision arithmetic --
    bf16 activations, FP8 projections --, whose rounding makes single elements near zero differ by
    more than any elementwise tolerance says about the whole). A layout that fails to
    build or run is a failed parity too: one line naming it (its exception is the
    :class:`ParityError`'s ``__context__``); a setting that cannot work on it (:class:`ConfigError`)
    is raised as it is.
    """
    md = model if isinstance(model, ModelDef) else ModelDef.create(
        model, rules=extend_rules(MEGATRON_RULES, rules or {}))
    devices = list(jax.devices() if devices is None else devices)
    chosen = [Layout.of(spec) for spec in layouts]
    batch = batch or math.lcm(8, *(layout.data * layout.m for layout in chosen))
    for layout in chosen:
        if layout.devices > len(devices):
            raise ValueError(f"layouts: {layout} needs {layout.devices} devices, "
                             f"{len(devices)} are present")
        if batch % (layout.data * layout.m):
            raise ValueError(f"batch: {batch} rows do not split into data={layout.data} x {layout.m} microbatches")
    rng = np.random.default_rng(seed)
    tokens = (packed_windows(rng, batch, seq_len, md.vocab_size) if documents else
              rng.integers(0, md.vocab_size, size=(batch, seq_len + 1), dtype=np.int32))
    single = build_mesh(MeshConfig(1, 1, 1), devices[:1])
    params = jax.device_get(md.init(single, seed))
    references: dict[int, tuple[float, Params]] = {}

    def reference(groups: int) -> tuple[float, Params]:
        # One device over the same groups of rows as the layout's data shards x microbatches: the
        # mean of per-group losses. For a token-wise loss that is the whole batch's mean; a loss that
        # depends on its group (a mixture of experts' load balance) is then compared like for like.
        if groups not in references:
            references[groups] = _gradients(md, Layout(1, 1, 1, microbatches=groups), params, tokens, devices,
                                            execution)
        return references[groups]

    names = leaf_names(reference(1)[1])
    scaling = jax.tree.leaves(md.probed_state())
    reports = []
    for layout in chosen:
        ref_loss, ref_grads = reference(layout.data * layout.m if grouped_loss else 1)
        try:
            loss, grads = _gradients(md, layout, params, tokens, devices, execution)
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 -- a program that fails to build or run is a report, not a traceback
            if raise_on_mismatch:
                raise ParityError(_failure(layout, error)) from None
            reports.append(ParityReport(layout, math.nan, ref_loss, "", math.nan, False, _failure(layout, error)))
            continue
        worst, worst_diff, ok = "", 0.0, math.isclose(loss, ref_loss, rel_tol=loss_rtol)
        for name, g, r, state in zip(names, jax.tree.leaves(grads), jax.tree.leaves(ref_grads), scaling, strict=True):
            if state:  # probed state and probes: statistics whose counts depend on the split, not a weight's gradient
                continue
            g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
            diff = float(np.max(np.abs(g - r))) if g.size else 0.0
            if diff >= worst_diff:
                worst, worst_diff = name, diff
            if norm_rtol is None:
                bad, bound = g.size and np.max(np.abs(g - r) - (atol + rtol * np.abs(r))) > 0, f"rtol {rtol}, atol {atol}"
            else:
                error, scale = float(np.linalg.norm(g - r)), float(np.linalg.norm(r))
                bad, bound = error > norm_rtol * scale + atol, f"norm {error:.3g} of {scale:.3g}, norm_rtol {norm_rtol}"
            if bad:
                ok = False
                if raise_on_mismatch:
                    raise ParityError(f"{layout}: gradient of {name} differs from one device by up to {diff:.3g} "
                                      f"({bound}); loss {loss:.7g} vs {ref_loss:.7g}")
        if not ok and raise_on_mismatch:
            raise ParityError(f"{layout}: loss {loss:.7g} differs from one device's {ref_loss:.7g}")
        reports.append(ParityReport(layout, loss, ref_loss, worst, worst_diff, ok))
    return reports


def packed_windows(rng: np.random.Generator, batch: int, seq_len: int, vocab: int) -> np.ndarray:
    """Random windows of packed documents ``[batch, seq_len + 1, 3]`` (token, segment, loss mask;
    :mod:`meshtron.models.documents`): each row cut into documents of 1 to ``seq_len / 2`` tokens
    numbered from 1, every odd row ending in padding (segment 0), and the first quarter of each
    document (a prompt) not counted in the loss."""
    out = np.zeros((batch, seq_len + 1, 3), np.int32)
    out[..., 0] = rng.integers(0, vocab, size=(batch, seq_len + 1))
    for row in range(batch):
        end = seq_len + 1 - (int(rng.integers(1, seq_len // 4 + 1)) if row % 2 else 0)
        start, segment = 0, 1
        while start < end:
            length = min(int(rng.integers(1, max(seq_len // 2, 1) + 1)), end - start)
            out[row, start : start + length, 1] = segment
            out[row, start + length // 4 : start + length, 2] = 1
            start, segment = start + length, segment + 1
    return out
