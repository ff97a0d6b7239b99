"""Model <-> pipeline glue: cutting any contract model into stage functions and placing layers on stages.

The canonical parameter tree stacks blocks as ``[layers, ...]``. Pipelining shards that axis over
``pipe``; for the interleaved schedule stage ``s`` must hold, for every chunk ``c``, layers
``c·L/v + s·L/(p·v) …`` (Megatron's placement), which is not a contiguous block. The training
state therefore keeps the layer axis in *stage order* -- a fixed permutation of the canonical
order, applied once when parameters enter training and undone when they leave (checkpoints,
comparisons) -- so that a plain ``P('pipe')`` sharding puts every layer on its stage with no
data movement during training. For ``v = 1`` the permutation is the identity.

With an uneven ``parallel.layout`` (:class:`~meshtron.pipeline.layout.StageLayout`) every chunk is
padded to the largest one: the stage-ordered axis is longer than the model's, its padding slots
hold zeros, and the runtime runs each chunk's own number of layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.models import documents
from meshtron.models.auxiliary import auxiliary_loss_scale
from meshtron.models.blocks import RESIDUAL, Context, run_blocks, run_layer
from meshtron.models.cast_weights import cast_weights
from meshtron.models.contract import ExtraLossReport, embed_tokens, extra_loss, next_token_pairs
from meshtron.models.fp8 import quantized_weights
from meshtron.models.preference import head_logps
from meshtron.pipeline.execution import PipelinePlan
from meshtron.pipeline.layout import StageLayout
from meshtron.pipeline.runtime import StageFunctions, run_pipeline, run_pipeline_forward
from meshtron.sharding import constrain, logical_to_spec
from meshtron.trace_context import current
from meshtron.train.forward_backward import ForwardBackward, as_microbatches
from meshtron.train.objective import LanguageModeling, Objective
from meshtron.train.state import ModelDef, Params

PIPE = "pipe"


def stage_order(layers: int, stages: int, chunks: int, layout: StageLayout | None = None) -> np.ndarray:
    """``perm[i]`` = canonical layer stored at position ``i`` of the stage-ordered layer axis (-1: a
    padding slot of an uneven ``layout``).

    Evenly split, position ``i = s·(L/p) + c·(L/(p·v)) + j`` (stage s, chunk c, layer j of the
    chunk) holds canonical layer ``c·(L/v) + s·(L/(p·v)) + j``.
    """
    return (layout or StageLayout.even(layers, stages, chunks)).stage_order()


def canonical_positions(order: np.ndarray) -> np.ndarray:
    """``pos[j]``: where canonical layer ``j`` sits in the stage-ordered axis ``order`` (the inverse of
    :func:`stage_order`, padding slots dropped)."""
    held = np.nonzero(order >= 0)[0]
    pos = np.empty(len(held), np.int64)
    pos[order[held]] = held
    return pos


def permute_layers(params: Params, perm: np.ndarray) -> Params:
    """Reorder the stacked layer axis of every block parameter (``blocks[...][i] = old[perm[i]]``,
    zeros where ``perm[i]`` is -1)."""
    if np.array_equal(perm, np.arange(len(perm))) and all(
            a.shape[0] == len(perm) for a in jax.tree.leaves(params["blocks"])):
        return params  # (an uneven layout's last padding slots are dropped by a leading identity too)
    index = jnp.asarray(np.maximum(perm, 0))
    if (perm >= 0).all():
        return {**params, "blocks": jax.tree.map(lambda a: jnp.take(a, index, axis=0), params["blocks"])}
    held = perm >= 0

    def take(a):
        mask = jnp.asarray(held).reshape(-1, *(1,) * (a.ndim - 1))
        return jnp.where(mask, jnp.take(a, index, axis=0), jnp.zeros((), a.dtype))

    return {**params, "blocks": jax.tree.map(take, params["blocks"])}


def to_stage_order(params: Params, layers: int, stages: int, chunks: int, layout: StageLayout | None = None) -> Params:
    return permute_layers(params, stage_order(layers, stages, chunks, layout))


def to_canonical(params: Params, layers: int, stages: int, chunks: int, layout: StageLayout | None = None) -> Params:
    return permute_layers(params, canonical_positions(stage_order(layers, stages, chunks, layout)))


def permute_state_layers(tree, params_treedef, perm: np.ndarray):
    """:func:`permute_layers` applied to every subtree of ``tree`` shaped like the parameters.

    Optimizer states mirror the parameters (moments, and 1-bit LAMB's per-layer ``[layers]``
    values), so their layer axis is in stage order too and must move with the parameters.
    """

    def param_shaped(node) -> bool:
        return isinstance(node, dict) and jax.tree.structure(node) == params_treedef

    return jax.tree.map(lambda node: permute_layers(node, perm) if param_shaped(node) else node, tree,
                        is_leaf=param_shaped)


def stage_functions(model_def: ModelDef, microbatches: int = 1, execution: Execution = DEFAULT_EXECUTION,
                    extra: list[str] | None = None, objective: Objective | None = None,
                    per_row: bool = False, packed: int = 0) -> StageFunctions:
    """A contract model cut into embedding and its ``prefix`` if it has one (first virtual stage:
    :func:`~meshtron.models.contract.embed_tokens`, on parameters replicated over the stages), a chunk of blocks, and head + loss
    (last virtual stage: the objective of :func:`~meshtron.models.contract.head_loss`, a model's further
    loss included). Activations between stages are ``x`` [rows, seq, hidden]; every stage reads its
    positions (and packed documents' segments) from the microbatch's tokens, which every stage holds
    (:meth:`~meshtron.models.blocks.Context.for_tokens`).

    The runtime seeds each microbatch's loss gradient with ``1/microbatches``; the blocks'
    auxiliary losses are seeded alike (:func:`~meshtron.models.auxiliary.auxiliary_loss_scale`), the
    head's too (a further loss's own blocks). Layers are recomputed as ``execution.remat`` says.

    ``extra``: the last stage computes the model's further loss (unweighted) instead of the objective,
    and appends its metric name to ``extra`` when traced (without one: the objective, nothing appended):
    what a forward-only pipeline reports. ``objective``: what the last stage computes (its
    ``head_loss``; default the next-token loss). ``per_row``: the last stage computes each row's summed
    counted-target log-probability instead (:func:`~meshtron.models.preference.head_logps`), ``[rows]``, or
    (``packed``: rows of up to that many packed pairs) each document's, ``[rows, packed]``."""
    aux_scale = 1.0 / microbatches
    objective = objective or LanguageModeling()

    def embed(shared: Params, tokens: jax.Array) -> jax.Array:
        with auxiliary_loss_scale(aux_scale):
            return embed_tokens(model_def.bind(shared), next_token_pairs(tokens)[0], Context.for_tokens(tokens),
                                remat=execution.remat)

    def stage(chunk_blocks: Params, x: jax.Array, tokens: jax.Array, active: jax.Array | None = None,
              weights=None) -> jax.Array:
        with auxiliary_loss_scale(aux_scale):
            return run_blocks(model_def.bind({"blocks": chunk_blocks}).blocks, x, Context.for_tokens(tokens),
                              remat=execution.remat, active=active, weights=weights)

    def loss(shared: Params, y: jax.Array, tokens: jax.Array) -> jax.Array:
        with auxiliary_loss_scale(aux_scale):
            if per_row:
                return head_logps(model_def.bind(shared), y, tokens, packed=packed)
            return objective.head_loss(model_def.bind(shared), y, tokens)

    def extra_value(shared: Params, y: jax.Array, tokens: jax.Array) -> jax.Array:
        found = extra_loss(model_def.bind(shared), y, tokens)
        if found is None:
            return loss(shared, y, tokens)
        extra.append(found.name)
        return found.value

    def layer(layer_blocks: Params, x: jax.Array, tokens: jax.Array, weights=None) -> jax.Array:
        # One block, as run_blocks applies each: the stacked module's graph with one layer's values.
        graphdef, state = nnx.split(model_def.bind({"blocks": layer_blocks}).blocks)
        ctx = Context.for_tokens(tokens)
        with auxiliary_loss_scale(aux_scale), documents.document_segments(ctx.segments):
            return constrain(run_layer(graphdef, state, x, ctx, weights), RESIDUAL)

    def prepare(stage_blocks: Params, x: jax.Array, tokens: jax.Array):
        # Every layer's weights quantized once for the step under FP8, else cast to the compute dtype once
        # (its projections' entries, stacked [chunks, layers, ...] like the parameters): the ticks' forwards,
        # recomputations and W passes all multiply by these instead of quantizing or casting again.
        chunks, layers = jax.tree.leaves(stage_blocks)[0].shape[:2]
        flat = jax.tree.map(lambda a: a.reshape(chunks * layers, *a.shape[2:]), stage_blocks)
        if current().fp8 == "off":
            # asked for, and no layer view making the weights per layer (ZeRO-3 gathering as each layer runs:
            # the whole stage would stay gathered)
            if not execution.cast_once or any(entry.view is not None for entry in current().layer_views):
                return None
            stacked = jax.lax.map(lambda layer_blocks: cast_weights(layer, layer_blocks, x, tokens), flat)
            held = {jnp.dtype(a.dtype) for a in jax.tree.leaves(flat)}
            if all(jnp.dtype(a.dtype) in held for a in jax.tree.leaves(stacked)):
                return None  # nothing cast: every weight multiplied as held (what was traced is dead code)
        else:
            stacked = jax.lax.map(lambda layer_blocks: quantized_weights(layer, layer_blocks, x, tokens), flat)
        if not jax.tree.leaves(stacked):
            return None
        return jax.tree.map(lambda a: a.reshape(chunks, layers, *a.shape[1:]), stacked)

    def reporting_stage(chunk_blocks: Params, x: jax.Array, tokens: jax.Array, active: jax.Array | None = None):
        return run_blocks(model_def.bind({"blocks": chunk_blocks}).blocks, x, Context.for_tokens(tokens),
                          active=active, collect=True)

    def chunk_specs():
        return jax.tree.map(lambda axes: logical_to_spec((None, *axes[1:])), model_def.logical_axes()["blocks"],
                            is_leaf=lambda x: isinstance(x, tuple))

    head = loss if extra is None else extra_value
    return StageFunctions(embed, stage, head, layout=lambda x: constrain(x, RESIDUAL), layer=layer,
                          remat=execution.remat, activation_spec=lambda: logical_to_spec(RESIDUAL),
                          chunk_specs=chunk_specs, reporting_stage=reporting_stage, prepare=prepare)


def pipelined_gradients(model_def: ModelDef, plan: PipelinePlan, execution: Execution = DEFAULT_EXECUTION,
                        objective: Objective | None = None):
    """``(params, tokens [m, rows, seq+1]) -> (loss, grads)`` running ``plan``'s program over ``pipe``.

    Called inside the trainer's data-parallel region; gradients are local to the data shard. With an
    uneven layout the parameters are padded as ``plan.layout`` says.
    """
    fns = stage_functions(model_def, plan.program.schedule.microbatches, execution, objective=objective)
    chunks = plan.chunks

    def per_stage(blocks: Params, shared: Params, tokens: jax.Array):
        # This stage's [layers/p, ...] block parameters, viewed as [chunks, layers/(p·v), ...].
        by_chunk = jax.tree.map(lambda a: a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:]), blocks)
        loss, g_blocks, g_shared = run_pipeline(plan, fns, by_chunk, shared, tokens, axis=PIPE)
        g_blocks = jax.tree.map(lambda g: g.reshape(g.shape[0] * g.shape[1], *g.shape[2:]), g_blocks)
        return loss, g_blocks, g_shared

    def gradients(params: Params, tokens: jax.Array):
        # Nested inside the data-parallel shard_map: the context mesh already has `data` manual.
        stage_map = jax.shard_map(
            per_stage,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(P(PIPE), P(), P()),
            out_specs=(P(), P(PIPE), P()),
            axis_names={PIPE},
            check_vma=plan.check_vma,
        )
        shared = {k: v for k, v in params.items() if k != "blocks"}
        loss, g_blocks, g_shared = stage_map(params["blocks"], shared, tokens)
        return loss, {**g_shared, "blocks": g_blocks}

    return gradients


def pipelined_loss(model_def: ModelDef, plan: PipelinePlan, reports: bool = False,
                   execution: Execution = DEFAULT_EXECUTION, extra: list[str] | None = None,
                   objective: Objective | None = None, per_row: bool = False, packed: int = 0):
    """``(params, tokens [m, rows, seq+1]) -> loss``: the forward-only pipeline (held-out evaluation).

    Same stages, layer placement and microbatches as training (``plan``'s), but a forward-only table:
    every stage keeps its own layers, so nothing is gathered over ``pipe`` (the plain forward pass would
    all-gather every pipe-sharded layer onto each device).

    ``reports=True``: ``-> (loss, reports)``, what the layers reported summed over the microbatches,
    stacked over the stage-ordered layer axis (as the block parameters are). ``extra``: the loss is the
    model's further loss instead, its name appended to ``extra`` when traced (:func:`stage_functions`).
    ``per_row=True``: ``-> [m, rows]``, each row's summed counted-target log-probability (DPO's, of the
    policy and of a frozen reference), from the last stage; with ``packed``, ``[m, rows, packed]``, each
    packed document's.
    """
    forward = plan.forward_only()
    fns = stage_functions(model_def, execution=execution, extra=extra, objective=objective, per_row=per_row,
                          packed=packed)
    chunks = plan.chunks

    def per_stage(blocks: Params, shared: Params, tokens: jax.Array):
        by_chunk = jax.tree.map(lambda a: a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:]), blocks)
        out = run_pipeline_forward(forward, fns, by_chunk, shared, tokens, axis=PIPE, reports=reports, per_row=per_row,
                                   row_shape=(packed,) if packed else ())
        if not reports:
            return out
        loss, found = out
        return loss, jax.tree.map(lambda r: r.reshape(r.shape[0] * r.shape[1], *r.shape[2:]), found)

    def loss(params: Params, tokens: jax.Array) -> jax.Array:
        stage_map = jax.shard_map(
            per_stage, mesh=jax.sharding.get_abstract_mesh(), in_specs=(P(PIPE), P(), P()),
            out_specs=(P(), P(PIPE)) if reports else P(), axis_names={PIPE}, check_vma=plan.check_vma,
        )
        return stage_map(params["blocks"], {k: v for k, v in params.items() if k != "blocks"}, tokens)

    return loss


def pipelined_forward_backward(model_def: ModelDef, plan: PipelinePlan, microbatches: int,
                               execution: Execution = DEFAULT_EXECUTION,
                               objective: Objective | None = None) -> ForwardBackward:
    """The pipeline runtime as the step's gradient source: ``plan``'s schedule over the ``microbatches`` for
    gradients, its forward-only twin for the loss, the layers' reports (those brought back from stage
    order to model order) and each row's summed log-probability (DPO's reference and metrics: every stage
    keeps its own layers); layers recomputed as ``execution.remat`` says; the loss ``objective``'s (its
    microbatches laid out as it says, its stages traced in its scope; default the next-token loss)."""
    objective = objective or LanguageModeling()
    sched = plan.program.schedule
    run_schedule = pipelined_gradients(model_def, plan, execution, objective)
    run_forward = pipelined_loss(model_def, plan, execution=execution, objective=objective)
    extra: list[str] = []  # the name of the model's further loss, once a report is traced
    run_reporting = pipelined_loss(model_def, plan, reports=True, execution=execution, extra=extra)
    run_rows = pipelined_loss(model_def, plan, execution=execution, per_row=True)
    # The metrics and a frozen copy's reference read packed pairs' values document by document; the
    # precomputed pass's rows are one pair a window pair.
    run_document_rows = (pipelined_loss(model_def, plan, execution=execution, per_row=True, packed=objective.packed)
                         if objective.packed else run_rows)
    model_order = jnp.asarray(canonical_positions(stage_order(model_def.layers, sched.stages, sched.chunks,
                                                              plan.layout)))

    def micro(tokens: jax.Array) -> jax.Array:
        return as_microbatches(tokens, microbatches)

    def reports(params: Params, tokens: jax.Array):
        extra_mean, found = run_reporting(params, micro(tokens))
        found = jax.tree.map(lambda r: jnp.take(r, model_order, axis=0), found)
        if not extra:
            return found
        return (*found, ExtraLossReport(extra_mean * microbatches, extra[0]))  # summed over the microbatches

    def scoped(run):
        def within(params: Params, tokens: jax.Array):
            with objective.pipelined():
                return run(params, objective.pipelined_rows(micro(tokens)))
        return within

    def row_logps(params: Params, tokens: jax.Array) -> jax.Array:
        return run_rows(params, micro(tokens)).reshape(-1)

    def reference_logps(params: Params, tokens: jax.Array) -> jax.Array:
        found = run_document_rows(params, micro(tokens))
        return found.reshape(-1, *found.shape[2:])

    def metrics(params: Params, tokens: jax.Array) -> dict[str, jax.Array]:
        with objective.pipelined():
            rows = run_document_rows(params, objective.pipelined_rows(micro(tokens)))
        return objective.head_metrics(rows, micro(tokens))

    return ForwardBackward(
        gradients=scoped(run_schedule),
        loss=scoped(run_forward),
        reports=reports,
        loss_groups=1,  # the runtime seeds each microbatch's loss at 1/m
        metrics=metrics if objective.METRICS else None,
        row_logps=row_logps,
        reference_logps=reference_logps,
    )
