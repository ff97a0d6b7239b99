"""Per-device memory of meshtron's own compiled train step, before it is compiled.

:mod:`meshtron.plan.model` prices Megatron-LM's runtime, the one the PTD-P paper measured. This
module models the program meshtron itself compiles -- for its GPT and Llama (grouped-query
attention, SwiGLU, untied head) or for the parameter bytes of any contract model -- on the fullest
device, term by term:

* **arguments**: the parameters and the optimizer state as ``parallel.zero`` splits them over ``data``
  (parameters at rest ``/d`` with zero=3, optimizer state ``/d`` with zero >= 1), and DPO's frozen
  reference copy of the starting weights where the run holds one (the stage's parameters, whole over
  ``data``: the step runs its forward; its activations are a forward's, freed before the backward's);
* **gradients**: the step accumulates a stage's gradients over the microbatches in the parameters'
  dtype, and while a microbatch's backward runs its own gradients are a second copy (they are added
  to the accumulator when it ends): ``2·G``. With zero=3 the accumulator is the device's ``1/d``
  share, plus one layer's gathered weights and whole gradient in flight (``2·layer``); gathering a
  stage's weights once per step (``parallel.gather_once``) keeps the gathered stage and whole
  gradients instead (``3·G``);
* **stash**: what full recomputation keeps -- the pipeline's stashed stage inputs (the schedule
  program's ``stash_slots``) and, while one chunk is recomputed, each of its layers' inputs;
* **layers kept**: with ``model.remat`` selective or none, every layer's backward residuals
  (:func:`meshtron.megatron.layer_activation_bytes`, the counts the tests hold to JAX's autodiff);
  with ``parallel.recompute=false``, those of every in-flight microbatch (the program's
  ``residual_slots``), or under ``model.remat=full`` each layer's input alone;
* **working**: what one layer's backward holds beyond that -- the working set of
  ``model.attention=xla``'s backward, the ``[b, heads/t, s, s]`` scores, their mask, probabilities
  and cotangents, four fp32 arrays (cuDNN's fused attention keeps none) -- or, with full
  recomputation, the layer's recomputed residuals if they are larger (a wide MLP, a long microbatch);
* **multi-token prediction** (deepseek's ``model.mtp.layers``): on the last stage, what each module's
  block keeps, rematerialised as the stack's are (under full recomputation its two inputs), and its
  own fp32 logits and their cotangent;
* **logits**: the last stage's fp32 logits and their cotangent, ``2 · b·s·V/t`` (every stage of an
  SPMD pipeline runs the same program, so every device reserves them);
* **host**: what the host offload switches keep in pinned host memory instead of on the device --
  under ``model.remat=offload`` each layer's input (in the compute dtype) where ``full`` keeps it on the
  device (a recomputed chunk's layer inputs, once per copy of the backward's code: once without a
  pipeline, whose microbatches all run through one accumulating loop; once per tick-loop segment that
  recomputes a stage with one; a zero-bubble ``B``'s residuals and ``parallel.recompute=false``'s residual
  slots stay on the device), and under ``train.offload_optimizer`` the optimizer state. It is
  not part of the device peak: the update moves the state in a few leaves at a time, after the
  backward's activations are freed, and XLA:GPU's programs of Llama-2 7B peak in the backward with it
  offloaded. XLA:CPU has one memory: there, nothing moves and these terms are the device's;
* **zero-bubble buffers** (zb-h1): the input-gradient pass ``B`` recomputes the chunk keeping every
  layer's residuals, and leaves per layer what the deferred weight gradient ``W`` needs of it (the
  weight-bearing projections' output cotangents; ``W`` reruns the chunk's forward from the stashed
  input for the activations it multiplies) in ``weight_slots`` B-to-W buffers.

With context parallelism (``parallel.context`` = c) every activation term counts the device's ``s/c`` tokens
of each sequence; the scores are what the exchange attends at once (:func:`score_elements`): the gathered
exchange's span every key (``[b, heads/t, s/c, s]``), the ring's one block, Ulysses's the whole sequence for
``heads/(t·c)`` heads, the hybrid's one ring block of its groups' tokens for ``heads/(t·u)`` heads; gradients
are reduced, and ``parallel.zero`` splits, over data x context.

Two backends, because XLA's buffer assignment is the backend's: ``gpu`` (what a GPU pod's program
holds) and ``cpu`` (XLA:CPU, the simulated mesh ``meshtron describe --compile`` compiles for). The
CPU cannot compute in bf16: it converts bf16 values to fp32, so a layer input it recomputes from is
held twice (2 + 4 bytes) and the residuals it keeps are the fp32 values (4 bytes); the bf16
attention probabilities are kept both ways (6 bytes). On a GPU the same values are 2 bytes. XLA:GPU
holds the attention backward's ``[s, s]`` working set as two fp32 and two bf16 arrays (XLA:CPU: four
fp32), and keeps the causal mask beside each layer's kept probabilities. These are the only terms
that differ; ``tests/test_step_memory.py`` and ``benchmarks/memory_at_scale.py`` hold the ``cpu``
figures to XLA:CPU's compiled programs of Llama-2 7B, 13B, 70B and Llama-3 8B, and the ``gpu`` figures
to XLA:GPU's for compile-only H100s, with XLA's attention and cuDNN's fused one
(``benchmarks/2026-11-29-memory-at-scale-gpu.md``).

Pure Python: no JAX (but for the pipeline's tick-loop segments under ``model.remat=offload``, which are
the runtime's own).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Any

from meshtron import megatron
from meshtron.config import Config, MlaConfig, ModelConfig, MoEConfig, padded_vocab_size
from meshtron.errors import ConfigError
from meshtron.families import FAMILIES
from meshtron.pipeline.program import compile_program
from meshtron.pipeline.schedules import make_schedule
from meshtron.plan.model import Layout, ModelShape, onebit_padded_length

__all__ = ["BACKENDS", "StepMemory", "StepRun", "StepShape", "block_activations", "block_parameters", "layout_step_memory",
           "other_parameters", "step_memory"]

BACKENDS = ("gpu", "cpu")
SCORE_BUFFERS = 4
"""``[b, heads/t, s, s]`` fp32 arrays ``jax.nn.dot_product_attention``'s XLA implementation holds on
XLA:CPU while a layer's backward runs: the scores, the causal mask broadcast to them, the probabilities
and their cotangent (read from XLA:CPU's buffer assignment of the 7B step)."""
GPU_SCORE_BUFFERS = (2, 2)
"""The same on XLA:GPU: ``(fp32, compute-dtype)`` arrays -- the fp32 scores and the probabilities'
cotangent, the probabilities in bf16 and their bf16 cotangent; the mask fuses into the softmax (read
from XLA:GPU's buffer assignment of the 7B steps compiled for H100s)."""
GPU_KEPT_MASK_BYTES = 1
"""Bytes per score a layer whose attention residuals autodiff keeps holds on XLA:GPU beyond the fp32
probabilities and their bf16 copy: the causal mask broadcast to ``[b, heads/t, s, s]`` (``pred``), kept
per layer (read from the H100 program of the 7B zb-h1 step, whose ``B`` keeps a chunk's residuals)."""
LOGIT_BUFFERS = 2  # fp32 logits and their cotangent


@dataclass(frozen=True)
class StepShape:
    """A built-in model's dimensions; its ``family`` (:mod:`meshtron.families`) counts its parameters."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp_dim: int
    vocab_size: int
    seq_len: int
    positions: int
    mla: MlaConfig | None = None  # deepseek's latent attention (model.mla)
    moe: MoEConfig | None = None  # a mixture of experts (model.moe; the deepseek family's counts read it)
    first_k_dense_replace: int = 0  # deepseek: dense blocks before the expert ones
    mtp_layers: int = 0  # deepseek: multi-token prediction modules after the last block (model.mtp.layers)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_config(cls, model: ModelConfig) -> StepShape:
        if model.factory is not None or model.family not in FAMILIES:
            what = f"factory {model.factory}" if model.factory else f"family {model.family}"
            raise ConfigError(f"model.family: the step memory model counts the built-in {' and '.join(FAMILIES)}, "
                              f"got {what}; "
                              "pass the model's parameter bytes (stage_bytes=) for a model of your own")
        return cls(model.family, model.layers, model.hidden, model.heads, model.kv_heads or model.heads,
                   model.mlp_dim, model.vocab_size, model.seq_len, model.max_position_embeddings or model.seq_len,
                   model.mla, model.moe, model.first_k_dense_replace, model.mtp.layers)


@dataclass(frozen=True)
class StepRun:
    """How the step runs: mesh sizes, microbatching, the pipeline program's buffer counts, and the
    dtypes, recomputation, attention, optimizer and zero level of the config."""

    data: int
    pipe: int
    tensor: int
    microbatch: int
    chunks: int = 1
    context: int = 1  # ranks each sequence is split over (parallel.context)
    context_attention: str = "gathered"  # how they exchange keys and values: gathered, ring, ulysses or hybrid
    ulysses_degree: int = 1  # hybrid: the ranks of each Ulysses group (parallel.ulysses_degree)
    stash_slots: int = 0  # pipeline: stashed stage inputs (0 without a pipeline)
    weight_slots: int = 0  # split backward (zb-h1): B-to-W buffers
    residual_slots: int = 0  # parallel.recompute=false: in-flight chunks whose residuals are kept
    remat: str = "full"
    offload_optimizer: bool = False  # train.offload_optimizer: the optimizer state in pinned host memory
    backward_segments: int = 1  # pipeline: tick-loop segments whose backward recomputes a stage
    sequence_parallel: bool = False
    zero: int = 0
    gather_once: bool = False
    optimizer: str = "adamw"
    param_bytes: int = 4
    compute_bytes: int = 2
    gather_bytes: int = 4  # zero=3: a gathered parameter's bytes (parallel.gather_dtype)
    reduce_bytes: int = 4  # zero=3: a gathered parameter's gradient's bytes as it is reduced (parallel.reduce_dtype)
    attention: str = "xla"
    frozen_reference: bool = False  # DPO's frozen copy of the starting weights: an argument of the step
    cast_once: bool = False  # parallel.cast_once in effect: a stage's weights in the compute dtype for the step

    @classmethod
    def from_config(cls, cfg: Config, program=None) -> StepRun:
        """``cfg`` with its resolved mesh; ``program``: its pipeline's compiled schedule (the slot counts)."""
        m, t, mesh = cfg.model, cfg.train, cfg.mesh
        microbatch = t.batch_size // (mesh.data * t.microbatches) * dpo_rows_per_pair(cfg)
        segments = 1
        if program is not None and m.remat == "offload":
            from meshtron.pipeline.runtime import segments as tick_segments  # imports JAX: the runtime's own

            segments = sum(seg.backward and seg.backward_recomputes for seg in tick_segments(program))
        return cls(
            data=mesh.data, pipe=mesh.pipe, tensor=mesh.tensor, microbatch=microbatch,
            chunks=cfg.pipeline.chunks if mesh.pipe > 1 else 1, context=mesh.context,
            context_attention=m.context_attention,
            ulysses_degree=m.ulysses_degree if m.context_attention == "hybrid" else 1,
            stash_slots=program.stash_slots if program is not None else 0,
            weight_slots=program.weight_slots if program is not None else 0,
            residual_slots=program.residual_slots if program is not None else 0,
            remat=m.remat, offload_optimizer=t.offload_optimizer,
            backward_segments=segments,
            sequence_parallel=m.sequence_parallel and mesh.tensor > 1, zero=t.zero,
            gather_once=t.gather_once, optimizer=t.optimizer, param_bytes=_itemsize(m.param_dtype),
            compute_bytes=_itemsize(m.dtype), gather_bytes=_itemsize(t.gather_dtype or m.dtype),
            reduce_bytes=_itemsize(t.reduce_dtype or m.param_dtype), attention=m.attention,
            frozen_reference=t.objective == "dpo" and not t.lora.rank and not t.dpo.precompute_reference,
            cast_once=(m.cast_once and mesh.pipe > 1 and m.fp8 == "off" and _itemsize(m.dtype) < _itemsize(m.param_dtype)
                       and not (t.zero == 3 and not t.gather_once)))


def dpo_rows_per_pair(cfg: Config) -> int:
    """Sequences the step runs per ``train.batch_size`` unit: 1 for the next-token loss; 2 for a DPO pair
    (chosen and rejected), 4 where a pipeline runs LoRA's frozen-base reference on copies of the rows
    (stashed through the stages like the policy's). A frozen copy's or a precomputed reference runs
    nothing in the step."""
    t = cfg.train
    if t.objective != "dpo":
        return 1
    doubled = t.lora.rank and not t.dpo.precompute_reference and cfg.mesh.pipe > 1
    return 4 if doubled else 2


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


@dataclass(frozen=True)
class StepMemory:
    """Bytes per device of one train step, by what holds them (see the module docstring)."""

    backend: str
    parameters: float
    optimizer: float
    gradients: float
    stash: float
    layers_kept: float
    working: float
    logits: float
    weight_buffers: float
    host: float = 0.0  # pinned host memory: offloaded layer inputs and optimizer state (not in the peak)
    mtp: float = 0.0  # deepseek: the multi-token prediction modules' residuals and logits (the last stage's)
    reference: float = 0.0  # DPO's frozen reference weights (an argument, not donated)
    cast_weights: float = 0.0  # parallel.cast_once: the stage's block weights in the compute dtype, for the step

    @property
    def arguments(self) -> float:
        """What the step takes: parameters and optimizer state (donated: the outputs reuse them), and a
        frozen DPO reference's weights."""
        return self.parameters + self.optimizer + self.reference

    @property
    def temporaries(self) -> float:
        return (self.gradients + self.stash + self.layers_kept + self.working + self.logits
                + self.weight_buffers + self.mtp + self.cast_weights)

    @property
    def peak(self) -> float:
        """The device's peak (what is held in host memory apart)."""
        return self.arguments + self.temporaries

    def terms(self) -> dict[str, float]:
        """Every non-zero term, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "backend" and getattr(self, f.name)}


def _counts(shape: StepShape):
    """The numbers of ``shape``'s family (:mod:`meshtron.families`)."""
    return FAMILIES[shape.family].load_counts()


def block_activations(shape: Any) -> megatron.BlockActivations:
    """What one block of ``shape``'s family keeps for its backward, per token: the family's
    ``block_activations(shape)`` where its constants depend on the shape (latent attention's widths, a
    mixture of experts), else its ``BLOCK``."""
    counts = _counts(shape)
    made = getattr(counts, "block_activations", None)
    return counts.BLOCK if made is None else made(shape)


def block_parameters(shape: StepShape, tensor: int) -> float:
    """One layer's parameters on one tensor rank: Megatron's split of the projections (query heads,
    and key/value heads when ``tensor`` divides them, else whole; the MLP's inner dimension), the
    norms and the row-parallel biases whole (the family's ``block_parameters``)."""
    return _counts(shape).block_parameters(shape, tensor)


def other_parameters(shape: StepShape, tensor: int) -> float:
    """The parameters outside the blocks on one tensor rank (vocabulary split over ``tensor``, padded
    to a multiple of 128·t as Megatron does). Every pipeline stage holds them: the program is SPMD."""
    return _counts(shape).other_parameters(shape, padded_vocab_size(shape.vocab_size, tensor), tensor)


def _weight_boundary(shape: StepShape, tensor: int) -> float:
    """Per token, the elements a zb-h1 ``B`` leaves for ``W``: each weight-bearing projection's output
    cotangent (the row-parallel ones' whole, ``h``; the rest split over ``tensor``)."""
    return _counts(shape).weight_boundary(shape, tensor)


def step_memory(shape: StepShape, run: StepRun, backend: str = "gpu", *,
                stage_bytes: tuple[float, float] | None = None,
                trainable_bytes: tuple[float, float] | None = None) -> StepMemory:
    """The step's bytes per device on ``backend`` (``gpu`` or ``cpu``).

    ``stage_bytes``: ``(one layer's, the rest's)`` parameter bytes per device when the model is not a
    built-in one (the blocks are then taken to be shaped like ``shape``'s for the activations).
    ``trainable_bytes``: the same of the parameters that train, when some are frozen (LoRA: the
    adapters); gradients and optimizer state are theirs alone (default: every parameter trains)."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    # d: the ranks gradients are reduced and parallel.zero splits over (data x context); s: a device's tokens
    # of each sequence (its attention's scores: score_elements)
    d, p, t, b = run.data * run.context, run.pipe, run.tensor, run.microbatch
    s, h, a = shape.seq_len // run.context, shape.hidden, shape.heads
    if stage_bytes is None:
        stage_bytes = (block_parameters(shape, t) * run.param_bytes, other_parameters(shape, t) * run.param_bytes)
    layer_bytes, rest_bytes = stage_bytes
    stage = shape.layers // p * layer_bytes + rest_bytes  # every device of a stage, before the zero split
    trained_layer, trained_rest = stage_bytes if trainable_bytes is None else trainable_bytes
    trained = shape.layers // p * trained_layer + trained_rest  # what has gradients and optimizer state
    cpu = backend == "cpu"
    cb = run.compute_bytes
    recompute_input = cb + (4 if cpu and cb < 4 else 0)  # a layer input the backward recomputes from
    residual = 4 if cpu else cb  # what autodiff keeps for the backward
    fused = run.attention == "cudnn" and not cpu

    parameters = stage / d if run.zero == 3 else stage
    optimizer = _optimizer_bytes(run, trained)
    offloads = not cpu  # XLA:CPU has one memory: what the switches offload stays in its figures
    host = 0.0
    if run.offload_optimizer and offloads:
        host, optimizer = optimizer, 0.0
    # (at zero=3 the gathered weights are counted here too: one layer's, or the whole stage's gathered once)
    gathered = run.gather_bytes / run.param_bytes  # a gathered weight's bytes per held byte
    if run.zero == 3 and not run.gather_once:
        gradients = 2 * trained / d + layer_bytes * gathered + trained_layer * run.reduce_bytes / run.param_bytes
    elif run.zero == 3:
        gradients = stage + 2 * trained  # (gathered in gather_dtype, held in the parameters' own)
    else:
        gradients = 2 * trained

    tokens = b * s / (t if run.sequence_parallel else 1)  # a residual-stream array's rows on one device
    chunk_layers = shape.layers // (p * run.chunks)
    stash = run.stash_slots * tokens * h * cb
    layers_kept = 0.0
    split = run.weight_slots > 0
    full = run.remat in ("full", "offload")  # offload: full with the layer inputs in host memory
    stage_recomputed = full and not run.residual_slots and not split  # from the stashed input
    inputs_kept = full and run.residual_slots > 0 and not split  # each layer's input, per slot
    if stage_recomputed and run.remat == "offload" and offloads:
        # Each copy of the backward's code holds its own host buffers (XLA:GPU shares none between them):
        # without a pipeline one, the accumulating loop's; with one, each tick-loop segment's whose
        # backward recomputes the stage.
        copies = 1 if p == 1 else run.backward_segments
        host += copies * chunk_layers * tokens * h * cb
    elif stage_recomputed or split:
        stash += chunk_layers * tokens * h * recompute_input
    scores_one = b * score_elements(shape, run)  # one [b, heads, queries, keys] array's elements
    # fp32 probabilities (+ a bf16 copy); XLA:GPU also keeps the causal mask broadcast to them (a byte each)
    kept_scores = 0.0 if fused else scores_one * ((4 + cb if cb < 4 else 8) + (0 if cpu else GPU_KEPT_MASK_BYTES))
    kept_layer = megatron.layer_activation_bytes(
        seq_len=s, microbatch=b, hidden=h, heads=a, kv_heads=shape.kv_heads, mlp_dim=shape.mlp_dim, tensor=t,
        sequence_parallel=run.sequence_parallel, remat="selective", bytes_per_element=residual,
        block=block_activations(shape))
    if split:  # B's residuals for the chunk, and what W reads in each B-to-W buffer
        layers_kept = chunk_layers * (kept_layer + kept_scores)
    elif inputs_kept:  # each layer's input (as autodiff keeps it) and the chunk's output, per slot
        layers_kept = run.residual_slots * (chunk_layers * residual + cb) * tokens * h
    elif run.residual_slots:  # slot buffers in the residuals' own dtypes: activations, fp32 probabilities
        slot_layer = kept_layer * cb / residual + (0.0 if fused else scores_one * 4)
        layers_kept = run.residual_slots * chunk_layers * slot_layer
    elif not full:
        layers_kept = chunk_layers * (kept_layer + (kept_scores if run.remat == "none" else 0.0))
    # The cotangents in the compute dtype on both backends: XLA:CPU's W converts a buffer to fp32 inside its
    # branch, where B's chunk residuals (the branch it alternates with) are larger.
    boundary = _weight_boundary(shape, t) * cb
    weight_buffers = run.weight_slots * chunk_layers * b * s * boundary
    score_bytes = SCORE_BUFFERS * 4 if cpu else GPU_SCORE_BUFFERS[0] * 4 + GPU_SCORE_BUFFERS[1] * cb
    working = 0.0 if fused else score_bytes * scores_one  # the attention core's backward
    if stage_recomputed or inputs_kept:  # full recomputation: one layer's residuals, recomputed, while its backward runs
        working = max(working, kept_layer + kept_scores)
    logits = LOGIT_BUFFERS * b * s * padded_vocab_size(shape.vocab_size, t) / t * 4
    # Multi-token prediction: each module runs one block and the head after the stack, rematerialised as the
    # stack's blocks are: it keeps what such a block keeps (under full recomputation its two inputs, the hidden
    # state and the embedded tokens) and its own logits.
    if full:
        module = 2 * tokens * h * recompute_input
    else:
        module = kept_layer + (kept_scores if run.remat == "none" else 0.0)
    mtp = shape.mtp_layers * (module + logits)
    reference = stage if run.frozen_reference else 0.0
    cast = shape.layers // p * layer_bytes * cb / run.param_bytes if run.cast_once else 0.0
    return StepMemory(backend, parameters, optimizer, gradients, stash, layers_kept, working, logits,
                      weight_buffers, host, mtp, reference, cast)


def score_elements(shape: StepShape, run: StepRun) -> float:
    """Elements of one sequence's attention scores a device computes at once, ``heads x queries x
    keys``, as the context exchange lays attention out (``S`` the sequence, ``c`` its ranks, ``t`` the
    tensor ranks): a whole sequence ``a/t · S · S``; ``gathered``: the rank's ``S/c`` queries against
    every key; ``ring``: one ``S/c x S/c`` block; ``ulysses``: the whole sequence for its ``a/(t·c)``
    heads (as many elements as gathered's); ``hybrid`` with ``u`` Ulysses ranks: one ring block of the
    ``S/r`` tokens a group of ``u`` holds, ``r = c/u``, for ``a/(t·u)`` heads (``u`` times the ring's)."""
    c, heads, seq = run.context, shape.heads / run.tensor, shape.seq_len
    exchange = run.context_attention if c > 1 else "gathered"
    if exchange == "gathered":
        return heads * (seq / c) * seq
    if exchange == "ring":
        return heads * (seq / c) ** 2
    if exchange == "ulysses":
        return heads / c * seq * seq
    if exchange == "hybrid":
        u = run.ulysses_degree
        return heads / u * (seq * u / c) ** 2
    raise ConfigError(f"parallel.context_attention: must be gathered, ring, ulysses or hybrid, got {exchange!r}")


def _optimizer_bytes(run: StepRun, stage: float) -> float:
    """AdamW and LAMB keep two moments in the parameters' dtype; 1-bit LAMB three plus its fp32 worker
    and server error buffers (:func:`meshtron.plan.model.onebit_padded_length`); ``/d`` with zero >= 1
    (``d``: data x context ranks)."""
    workers = run.data * run.context  # the gradient group: data x context
    if run.optimizer != "onebit_lamb":
        return 2 * stage / (workers if run.zero >= 1 else 1)
    errors = 0.0
    if workers > 1:
        padded = onebit_padded_length(math.ceil(stage / run.param_bytes), workers)
        errors = 4 * (padded + padded / workers)
    return 3 * stage + errors


@functools.lru_cache(maxsize=256)
def _slots(schedule: str, pipe: int, microbatches: int, chunks: int) -> tuple[int, int]:
    """(stash, B-to-W) slots of meshtron's program for this schedule. Except GPipe's (all ``m``), the
    peak is reached within the first ``2p`` microbatches, so the table is built for at most that many."""
    built = microbatches if schedule == "gpipe" else min(microbatches, 2 * pipe)
    program = compile_program(make_schedule(schedule, pipe, built, chunks))
    return program.stash_slots, program.weight_slots


def layout_step_memory(model: ModelShape, layout: Layout, optimizer: str = "adamw", zero: int = 0,
                       schedule: str | None = None) -> StepMemory | None:
    """meshtron's step on a GPU for one of the planner's layouts of the paper's GPT: fp32 parameters and
    bf16 compute (meshtron's mixed precision), cuDNN's fused attention, no sequence parallelism, the
    layout's schedule (1F1B, or interleaved when ``chunks > 1``) unless ``schedule`` names another, each
    sequence split over the layout's context ranks as its exchange lays attention out.
    None when meshtron's tables cannot run the layout (fewer microbatches than stages)."""
    p, m = layout.pipe, layout.microbatches
    schedule = schedule or layout.schedule
    if p > 1 and m < p:
        return None
    stash, weights = _slots(schedule, p, m, layout.chunks) if p > 1 else (0, 0)
    shape = StepShape("gpt", model.layers, model.hidden, model.heads, model.heads, 4 * model.hidden,
                      model.vocab_size, model.seq_len, model.seq_len)
    run = StepRun(data=layout.data, pipe=p, tensor=layout.tensor, microbatch=layout.microbatch, chunks=layout.chunks,
                  context=layout.context, context_attention=layout.context_attention,
                  ulysses_degree=layout.ulysses_degree, stash_slots=stash, weight_slots=weights, remat=layout.recompute, zero=zero, optimizer=optimizer,
                  attention="cudnn")
    return step_memory(shape, run, "gpu")

