"""What a layout costs, independent of the hardware: parameters, FLOPs, bytes in memory and on the wire.

The counting half of the planner (:mod:`meshtron.plan.timing` turns it into seconds on a cluster).
It models the paper's runtime -- Megatron-LM as Narayanan et al. (SC21) ran it: 16-bit weights and
activations, fp32 master weights and optimizer state, 1F1B or interleaved 1F1B pipelining with the
scatter/gather optimisation (§4.1), activations checkpointed at every layer's input when
recomputing (§3.5). Formulas that :mod:`meshtron.megatron` holds against compiled programs
are *called* from there, not copied: eq. 2 and 3 (:func:`~meshtron.megatron.megatron_params`,
:func:`~meshtron.megatron.megatron_flops`), the per-axis communication figures
(:func:`~meshtron.megatron.megatron_figures`), the activation memory of Korthikanti et al.
(:func:`~meshtron.megatron.paper_layer_activation_bytes`,
:func:`~meshtron.megatron.megatron_stage_activation_bytes`) and the ring traffic
(:func:`~meshtron.hlo.collectives.ring_wire_bytes`). In-flight microbatches come from the schedule
tables of :mod:`meshtron.pipeline.schedules`. No JAX here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from meshtron import megatron
from meshtron.config import OPTIMIZERS, ModelConfig
from meshtron.errors import ConfigError
from meshtron.families import FAMILIES
from meshtron.hlo.collectives import ring_wire_bytes
from meshtron.pipeline.schedules import check, make_schedule

__all__ = [
    "ACTIVATION_BYTES",
    "FP32_GRADIENTS",
    "GRADIENTS",
    "GRADIENT_BYTES",
    "PLANNED_FAMILIES",
    "RECOMPUTE",
    "Gradients",
    "Layout",
    "Memory",
    "ModelShape",
    "activation_bytes",
    "data_wire_bytes",
    "figures",
    "flops_per_iteration",
    "in_flight_chunks",
    "layer_activation_bytes",
    "layer_matrix_parameters",
    "layer_parameters_per_gpu",
    "layer_score_bytes",
    "memory_per_gpu",
    "onebit_padded_length",
    "optimizer_bytes_per_parameter",
    "parameter_count",
    "pipe_wire_bytes",
    "score_share",
    "stage_parameters_per_gpu",
    "tensor_wire_bytes",
    "transformer_flops",
]

RECOMPUTE = ("full", "selective", "none")  # the planner's order of preference when times tie
ACTIVATION_BYTES = 2  # 16-bit weights and activations (mixed precision, §5)
GRADIENT_BYTES = 4
"""Megatron-LM accumulates gradients over the microbatches, and all-reduces them, in fp32
(``--accumulate-allreduce-grads-in-fp32``, which bf16 training requires): 4 bytes per parameter in
memory and on the wire (:func:`meshtron.megatron.megatron_figures`' default element size too)."""

OVERLAP = ("never", "unpipelined", "always")

MEMORY_MODEL = ("Megatron-LM's mixed precision as the paper ran it (16-bit weights, fp32 master weights and "
                "moments; the paper's activations at Megatron's in-flight microbatches), not the config's dtypes")
"""What the planner's memory per GPU counts (``meshtron plan`` and ``describe``'s plan say it)."""


@dataclass(frozen=True)
class Gradients:
    """How the training program keeps and exchanges gradients: the part of a step's memory and
    data-parallel time that the layout does not decide.

    ``element_bytes``: the accumulation buffer's and the data-parallel all-reduce's element (4:
    fp32; 2: fp16/bf16, Megatron-LM without ``--accumulate-allreduce-grads-in-fp32``).
    ``step_copy_bytes``: per parameter, a copy the optimizer step makes and frees before the next
    forward (Megatron-LM's fp16 optimizer of 2021 sets every fp32 master weight's ``.grad`` to
    ``model_grad.float()``: 4), alive while the activations are not. ``overlap``: when the
    all-reduce hides behind the backward -- ``never`` (Megatron-LM's ``local`` DDP, after the last
    microbatch), ``unpipelined`` (``torch`` DDP, which Megatron-LM of 2021 could use only without
    pipelining), ``always``. ``bucket_bytes``: per parameter, the gradient copy an overlapping DDP
    keeps in its buckets (PyTorch's, without ``gradient_as_bucket_view``: 2 for 16-bit gradients).
    ``zero``: what is split over the data-parallel ranks (Rajbhandari et al.): 0 nothing; 1 the fp32
    master weights and moments (Megatron-LM's ``--use-distributed-optimizer``: gradients
    reduce-scattered, updated 16-bit weights all-gathered); 3 the weights and gradients too (fully
    sharded: every layer's weights gathered in the forward and again in the backward of every
    microbatch, its gradient reduce-scattered)."""

    element_bytes: int = GRADIENT_BYTES
    step_copy_bytes: int = 0
    overlap: str = "never"
    bucket_bytes: int = 0
    zero: int = 0

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAP:
            raise ConfigError(f"gradients.overlap: must be one of {', '.join(OVERLAP)}, got {self.overlap!r}")
        if self.zero not in (0, 1, 3):
            raise ConfigError(f"--zero: must be 0, 1 or 3, got {self.zero!r}")

    def overlapped(self, layout: Layout) -> bool:
        """Whether this layout's data-parallel all-reduce hides behind its backward."""
        return self.overlap == "always" or (self.overlap == "unpipelined" and layout.pipe == 1)


FP32_GRADIENTS = Gradients()

GRADIENTS = {
    "fp32": FP32_GRADIENTS,
    "16bit": Gradients(element_bytes=2),
    "sc21": Gradients(element_bytes=2, step_copy_bytes=4, overlap="unpipelined", bucket_bytes=2),
}
"""``--gradients``: ``fp32`` (the default: Megatron-LM's bf16 practice, meshtron's too), ``16bit``
(gradients accumulated and all-reduced in 16 bits), ``sc21`` (the PTD-P paper's runs, Megatron-LM of
2021 as ``examples/sc21/run_table_1.sh`` ran it: ``--fp16`` without fp32 accumulation, the fp16
optimizer's fp32 gradient copy at the step, ``torch`` DDP on the rows without pipelining and
``local`` on the rest)."""


PLANNED_FAMILIES = ("gpt", "llama")
"""The built-in families the planner prices: the paper's GPT and the Llama family."""


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder the planner prices: ``layers`` (l), ``hidden`` (h), ``heads`` (a), ``seq_len``
    (s), ``vocab_size`` (V) -- the paper's GPT (§5.1) by default, whose MLP is 4h wide as eq. 2 and 3
    assume -- and, for ``family="llama"``, the Llama block as Megatron-LM runs it: ``kv_heads`` (k)
    key/value heads (grouped-query attention, k dividing a; default a), a SwiGLU MLP of three
    ``mlp_dim`` (f) wide matrices, RMSNorm, no biases, rotary positions and an untied LM head.
    ``kv_heads`` and ``mlp_dim`` are filled in (a and 4h) when not given."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab_size: int
    family: str = "gpt"
    kv_heads: int | None = None
    mlp_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}: must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ConfigError(f"model.hidden: {self.hidden} is not divisible by model.heads={self.heads}")
        if self.family not in PLANNED_FAMILIES:
            raise ConfigError(f"model.family: the planner prices {' and '.join(PLANNED_FAMILIES)}, got "
                              f"{self.family!r}")
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        object.__setattr__(self, "mlp_dim", self.mlp_dim or 4 * self.hidden)
        if self.family == "gpt" and (self.kv_heads != self.heads or self.mlp_dim != 4 * self.hidden):
            raise ConfigError(f"model.mlp_dim: the paper's GPT (eq. 2, 3) has one key/value head per head and a "
                              f"4 x hidden = {4 * self.hidden} MLP, got kv_heads={self.kv_heads}, "
                              f"mlp_dim={self.mlp_dim}; price other shapes as model.family=llama")
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ConfigError(f"model.kv_heads: {self.kv_heads} does not divide model.heads={self.heads}")
        if self.mlp_dim < 1:
            raise ConfigError(f"model.mlp_dim: must be >= 1, got {self.mlp_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tied_head(self) -> bool:
        """The paper's GPT multiplies by its word embedding to make the logits; Llama has its own head."""
        return self.family == "gpt"

    @classmethod
    def from_config(cls, model: ModelConfig) -> ModelShape:
        """The shape of a config's model: the paper's GPT with a 4h MLP, or a dense Llama
        (``model.kv_heads``, ``model.mlp_dim``)."""
        family = FAMILIES.get(model.family) if model.factory is None else None
        if family is None or model.family not in PLANNED_FAMILIES:
            what = f"factory {model.factory}" if model.factory else f"family {model.family}"
            raise ConfigError(f"model.family: the planner prices the paper's GPT (eq. 2, 3) and the Llama family, "
                              f"got {what}; use model.family=gpt or llama")
        if model.moe.experts:
            raise ConfigError(f"model.moe.experts: the planner prices dense models, got {model.moe.experts} "
                              "experts; set model.moe.experts=0")
        if family.load_counts().PAPER_GPT:
            if model.mlp_dim != 4 * model.hidden:
                raise ConfigError(f"model.mlp_dim: the paper's formulas assume 4 x hidden = {4 * model.hidden}, "
                                  f"got {model.mlp_dim}; set model.mlp_dim={4 * model.hidden}")
            return cls(model.layers, model.hidden, model.heads, model.seq_len, model.vocab_size)
        return cls(model.layers, model.hidden, model.heads, model.seq_len, model.vocab_size, model.family,
                   family.load_counts().kv_heads(model), model.mlp_dim)


@dataclass(frozen=True)
class Layout:
    """One way to run the model: tensor (t), pipeline (p) and data (d) parallel sizes, model chunks
    per pipeline stage (v; v > 1 is the interleaved schedule), microbatch size (b), global batch
    (B), the activation recomputation mode, and context ranks (c) each sequence is split over
    (every GPU then holds ``s/c`` of each of its microbatch's sequences, and attends over all ``s``
    with the exchange ``context_attention`` names, ``parallel.context_attention``: keys and values
    all-gathered over the c ranks, passed around a ring, all-to-all'd into a head split (``ulysses``),
    or ``hybrid``: Ulysses over groups of ``ulysses_degree`` ranks, a ring across the groups).
    ``sequence_parallel`` (Korthikanti et al. 2022, §4.2.2; t > 1): outside the tensor-parallel regions
    (norms, residual adds, dropouts) every tensor rank holds and computes ``s/t`` of the sequence, and
    each all-reduce becomes a reduce-scatter and an all-gather of the same bytes."""

    tensor: int
    pipe: int
    data: int
    microbatch: int
    global_batch: int
    chunks: int = 1
    recompute: str = "full"
    context: int = 1
    sequence_parallel: bool = False
    context_attention: str = "gathered"
    ulysses_degree: int = 1  # hybrid's Ulysses group (1 < u < c); ulysses is u = c

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipe * self.data * self.context

    @property
    def replicas(self) -> int:
        """The gradient group: data x context ranks (each context rank's gradient covers its tokens)."""
        return self.data * self.context

    @property
    def microbatches(self) -> int:
        """m = B / (d·b), microbatches per pipeline per batch (§3.1)."""
        return self.global_batch // (self.data * self.microbatch)

    @property
    def schedule(self) -> str:
        return "interleaved" if self.chunks > 1 else "1f1b"

    def problem(self, model: ModelShape) -> str | None:
        """Why this layout cannot run ``model`` (one line naming the constraint), or None."""
        t, p, d, b, v = self.tensor, self.pipe, self.data, self.microbatch, self.chunks
        if min(t, p, d, b, v, self.global_batch) < 1:
            return "every size must be >= 1"
        if self.recompute not in RECOMPUTE:
            return f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}"
        if model.heads % t:
            return f"tensor={t} does not divide the {model.heads} heads"
        if model.layers % (p * v):
            return f"pipe x chunks = {p * v} does not divide the {model.layers} layers"
        if self.global_batch % (d * b):
            return f"global batch {self.global_batch} is not divisible by data x microbatch = {d * b}"
        if v > 1 and (p == 1 or self.microbatches % p):
            return f"the interleaved schedule needs pipe > 1 and microbatches ({self.microbatches}) a multiple of {p}"
        if self.context < 1 or model.seq_len % (2 * self.context):
            return f"context={self.context} needs seq_len ({model.seq_len}) divisible by 2 x context"
        if self.context > 1:
            exchange_problem = context_problem(self.context_attention, self.context, self.ulysses_degree,
                                               model.heads // t)
            if exchange_problem is not None:
                return exchange_problem
        if self.sequence_parallel and t == 1:
            return "sequence_parallel splits over the tensor ranks and needs tensor > 1"
        if self.sequence_parallel and (model.seq_len // self.context) % t:
            return f"sequence_parallel needs tensor={t} to divide the {model.seq_len // self.context} tokens per sequence"
        return None

    def check(self, model: ModelShape) -> None:
        problem = self.problem(model)
        if problem is not None:
            raise ConfigError(f"layout t={self.tensor} p={self.pipe} d={self.data}: {problem}")


# ----------------------------------------------------------------------------------------------
# Model size and work


def layer_matrix_parameters(model: ModelShape) -> int:
    """The weights of one layer's matrices, whole: the GPT's QKV, projection and two 4h MLP matrices
    (``12h²``); Llama's query and output projections (``2·h·a·d``), its key and value projections
    (``2·h·k·d``: grouped-query attention's smaller ones) and SwiGLU's gate, up and down (``3·h·f``).
    Each weight is one multiply-add per token in the forward: the layer's GEMM FLOPs are twice this
    per token."""
    h, a, k, d, f = model.hidden, model.heads, model.kv_heads, model.head_dim, model.mlp_dim
    if model.family == "gpt":
        return 4 * h * h + 2 * h * f
    return 2 * h * a * d + 2 * h * k * d + 3 * h * f


def parameter_count(model: ModelShape) -> int:
    """Eq. 2 (§5.1) for the GPT: ``12lh² + 13lh + (V+s)h`` (:func:`meshtron.megatron.megatron_params`).
    Llama: per layer its matrices (:func:`layer_matrix_parameters`) and two RMSNorm scales (``2h``),
    plus the embedding and the untied head (``2Vh``) and the final norm (``h``)."""
    if model.family == "gpt":
        return megatron.megatron_params(vocab_size=model.vocab_size, hidden=model.hidden, layers=model.layers,
                                        seq_len=model.seq_len)
    h = model.hidden
    return model.layers * (layer_matrix_parameters(model) + 2 * h) + 2 * model.vocab_size * h + h


def transformer_flops(model: ModelShape, global_batch: int, recompute: str = "full") -> int:
    """GEMM FLOPs of one iteration counted from the shape: per layer and token ``2·`` its matrix
    weights (:func:`layer_matrix_parameters`) plus the attention core's ``4·s·h`` (scores and their
    product with the values, whatever the key/value heads), per forward; the backward twice the
    forward; the recomputed forward again with ``full``, the attention core again with ``selective``;
    the LM head ``6·B·s·h·V``. For the GPT this is eq. 3 (the tests hold it to
    :func:`meshtron.megatron.megatron_flops`)."""
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    B, s, h, l = global_batch, model.seq_len, model.hidden, model.layers
    passes = 4 if recompute == "full" else 3
    attention = 4 * B * s * s * l * h * (passes + (recompute == "selective"))
    return passes * 2 * B * s * l * layer_matrix_parameters(model) + attention + 6 * B * s * h * model.vocab_size


def flops_per_iteration(model: ModelShape, global_batch: int, recompute: str = "full") -> int:
    """Eq. 3 (§5.1, appendix) for ``recompute="full"``, the FLOPs the paper divides by time to report
    TF/s; ``selective``/``none`` count only what those modes execute
    (:func:`meshtron.megatron.megatron_flops`). Other families: :func:`transformer_flops`."""
    if model.family != "gpt":
        return transformer_flops(model, global_batch, recompute)
    return megatron.megatron_flops(vocab_size=model.vocab_size, hidden=model.hidden, layers=model.layers,
                                   seq_len=model.seq_len, global_batch=global_batch, recompute=recompute)


def figures(model: ModelShape, layout: Layout) -> megatron.MegatronFigures:
    """:func:`meshtron.megatron.megatron_figures` for this layout, in 16-bit elements: the per-axis
    bytes the tests hold meshtron's compiled programs to. The tensor and pipeline figures hold for the
    Llama family too (every all-reduce and exchange is one microbatch's ``b·s·h``; with sequence
    parallelism a reduce-scatter and an all-gather of the same bytes); its parameters, FLOPs and
    gradient shard are its own (:func:`parameter_count`, :func:`transformer_flops`)."""
    fig = megatron.megatron_figures(
        vocab_size=model.vocab_size, hidden=model.hidden, layers=model.layers, seq_len=model.seq_len,
        heads=model.heads, global_batch=layout.global_batch, data=layout.data, pipe=layout.pipe,
        tensor=layout.tensor, microbatches=layout.microbatches, remat=layout.recompute == "full",
        bytes_per_element=ACTIVATION_BYTES,
    )
    if model.family == "gpt":
        return fig
    params = parameter_count(model)
    return dataclasses.replace(
        fig, params=params, flops_per_iteration=transformer_flops(model, layout.global_batch, "full"),
        flops_per_iteration_no_remat=transformer_flops(model, layout.global_batch, "none"),
        data_bytes=round(params * ACTIVATION_BYTES / (layout.tensor * layout.pipe)) if layout.data > 1 else 0)


def layer_parameters_per_gpu(model: ModelShape, tensor: int) -> float:
    """One transformer layer's parameters on one tensor rank (Megatron's split, §2.3): the QKV and
    first MLP matrices and biases split by columns, the projection and second MLP matrices by rows
    with their biases whole, the two layer norms whole -- ``12h²/t + 7h/t + 6h`` (``12h² + 13h`` at
    ``t = 1``, eq. 2's per-layer term). Llama: the family's own count
    (:func:`meshtron.models.llama_counts.block_parameters`: key/value projections split when ``t``
    divides their heads, else whole; the RMSNorm scales whole)."""
    h, t = model.hidden, tensor
    if model.family != "gpt":
        return FAMILIES[model.family].load_counts().block_parameters(model, tensor)
    return 12 * h * h / t + 7 * h / t + 6 * h


def stage_parameters_per_gpu(model: ModelShape, layout: Layout) -> float:
    """Parameters on one GPU of the fullest pipeline stage: ``l/p`` layers plus the vocab-parallel
    word embedding (``V·h/t``) and position embedding (``s·h``) on the first stage and the LM head
    (the tied word embedding's copy, ``V·h/t``) and final layer norm on the last; with ``p = 1``
    one stage holds all of it once. Llama: the embedding (``V·h/t``) on the first stage, its own head
    (``V·h/t``) and final RMSNorm on the last, both on a single stage."""
    h, t = model.hidden, layout.tensor
    layers = model.layers // layout.pipe * layer_parameters_per_gpu(model, t)
    if not model.tied_head:
        first, last = model.vocab_size * h / t, model.vocab_size * h / t + h
        return layers + (first + last if layout.pipe == 1 else max(first, last))
    first = model.vocab_size * h / t + model.seq_len * h
    last = model.vocab_size * h / t + 2 * h
    if layout.pipe == 1:
        return layers + first + 2 * h
    return layers + max(first, last)


# ----------------------------------------------------------------------------------------------
# Memory


def optimizer_bytes_per_parameter(optimizer: str, data: int) -> float:
    """Bytes of optimizer state per parameter in mixed precision (Rajbhandari et al., ZeRO, §3.1):
    AdamW and LAMB keep an fp32 master copy and two fp32 moments (12 bytes). 1-bit LAMB
    (:mod:`meshtron.optim.onebit_lamb`) also keeps the fresh variance v̂ (4), the per-device worker
    error (4, the padded momentum's length) and the server error (4/d, the worker's chunk of it)."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer: must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if optimizer == "onebit_lamb":
        return 12 + 4 + (4 + 4 / data if data > 1 else 0)
    return 12


@functools.lru_cache(maxsize=512)
def in_flight_chunks(pipe: int, microbatches: int, chunks: int) -> int:
    """Chunk-microbatches whose activations stage 0 holds at once under Megatron-LM's schedule: ``p``
    for 1F1B, ``2(p−1) + (v−1)p + 1`` interleaved (capped at ``m·v``) -- read from the schedule
    table's checker (``ScheduleStats.megatron_peak_in_flight_stage0``), not restated here.

    The peak is reached within the first ``2p`` microbatches (warmup is at most ``(v+1)p − 1``
    chunk-microbatches), so the table is built for ``min(m, 2p)`` of them: the same peak at a cost
    that does not grow with the batch."""
    if pipe == 1:
        return 1  # gradient accumulation: one microbatch at a time
    if microbatches < pipe:  # Megatron runs it (all warmup, then all cooldown); meshtron's tables refuse it
        return microbatches
    schedule = "interleaved" if chunks > 1 else "1f1b"
    return check(make_schedule(schedule, pipe, min(microbatches, 2 * pipe), chunks)).megatron_peak_in_flight_stage0


def activation_bytes(model: ModelShape, layout: Layout) -> float:
    """Activation bytes on pipeline stage 0, the fullest (Korthikanti et al. 2022, Table 2 and §4.2.3).

    Each in-flight chunk-microbatch (:func:`in_flight_chunks`) keeps what its ``l/(p·v)`` layers
    need for the backward (:func:`meshtron.megatron.megatron_stage_activation_bytes`): with full
    recomputation only every layer's 16-bit input (``2sbh``, checkpointing every layer, §3.5), plus
    one layer's full activations while it is recomputed and differentiated; with selective or no
    recomputation Table 2's per-layer figures (:func:`meshtron.megatron.paper_layer_activation_bytes`).
    The last stage's logits, ``b·s·V/t`` in 16 bits and again in fp32 for the loss, are added: a
    bound for stages that hold both."""
    s, b, t, c = model.seq_len, layout.microbatch, layout.tensor, layout.context
    share = score_share(layout)

    def on_rank(remat: str) -> float:
        # A context rank holds s/c of every sequence: each term is linear in its own tokens, so divides by c,
        # except the scores, which are what the exchange attends at once (score_share)
        return (layer_activation_bytes(model, layout, remat) / c
                + layer_score_bytes(model, layout, remat) * (share - 1 / c))

    chunk_layers = model.layers // (layout.pipe * layout.chunks)
    kept = megatron.megatron_stage_activation_bytes(
        layer_bytes=on_rank(layout.recompute), layers_per_stage=chunk_layers,
        in_flight=in_flight_chunks(layout.pipe, layout.microbatches, layout.chunks))
    working = on_rank("none") if layout.recompute == "full" else 0.0
    logits = b * s * model.vocab_size / t * (ACTIVATION_BYTES + 4)
    return kept + working + logits / c


def score_share(layout: Layout) -> float:
    """The part of a whole sequence's attention scores (``a/t · s · s``) a context rank holds at once, as
    its exchange lays attention out (:func:`meshtron.plan.step_memory.score_elements`, which the step memory
    model counts): ``1/c`` for the gathered exchange (``s/c`` queries against every key) and Ulysses (the
    whole sequence for ``1/c`` of the heads); the ring's one ``s/c x s/c`` block, ``1/c²``; the hybrid's
    block of a group's ``u·s/c`` tokens for ``1/u`` of the heads, ``u/c²``."""
    c = layout.context
    if c == 1:
        return 1.0
    if layout.context_attention == "gathered":
        return 1 / c
    return ulysses_ranks(layout.context_attention, c, layout.ulysses_degree) / c**2


def layer_score_bytes(model: ModelShape, layout: Layout, remat: str) -> float:
    """The attention scores' part of :func:`layer_activation_bytes` (whole sequences): Table 2's
    ``5·a·s²·b/t`` for the GPT (softmax output, dropout mask and output), the Llama block's softmax output
    ``2·a·s²·b/t``; nothing when recomputation drops them (``selective``, ``full``)."""
    if remat != "none":
        return 0.0
    per_score = 5 if model.family == "gpt" else 2
    return per_score * model.heads * model.seq_len**2 * layout.microbatch / layout.tensor


def layer_activation_bytes(model: ModelShape, layout: Layout, remat: str) -> float:
    """Bytes one layer keeps for its backward under Megatron-LM, whole sequences (``s``, not ``s/c``).

    The GPT: Korthikanti et al.'s Table 2 (:func:`meshtron.megatron.paper_layer_activation_bytes`),
    with sequence parallelism when the layout has it. The Llama block, counted the same way in 16-bit
    values with no dropout: outside the tensor-parallel regions the two norms' inputs and the two norm
    outputs entering attention and the MLP (``8·s·b·h`` bytes, ``/t`` with sequence parallelism, which
    keeps the norm outputs split as Megatron-LM does); inside, the rotated queries and the attention
    output (``4·s·b·h/t``), keys and values (``4·s·b·k·d``, ``/t`` when ``t`` divides the ``k`` heads),
    SwiGLU's gate and up outputs and their product (``6·s·b·f/t``), and the softmax output
    (``2·a·s²·b/t``, which ``selective`` recomputes). ``full`` keeps the layer input (``2·s·b·h``,
    ``/t`` with sequence parallelism)."""
    s, b, h, a, t = model.seq_len, layout.microbatch, model.hidden, model.heads, layout.tensor
    sp = layout.sequence_parallel
    if model.family == "gpt":
        return megatron.paper_layer_activation_bytes(seq_len=s, microbatch=b, hidden=h, heads=a, tensor=t,
                                                     sequence_parallel=sp, remat=remat)
    if remat == "full":
        return 2 * s * b * h / (t if sp else 1)
    k, d, f = model.kv_heads, model.head_dim, model.mlp_dim
    kv_split = t if k % t == 0 else 1
    inside = (4 * h + 6 * f) / t + 4 * k * d / kv_split + (2 * a * s / t if remat == "none" else 0.0)
    return s * b * (8 * h / (t if sp else 1) + inside)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the fullest stage, by what holds them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    step_copy: float = 0.0  # alive only during the optimizer step, when the activations are freed

    @property
    def total(self) -> float:
        """The peak: during the forward and backward, or during the optimizer step."""
        return self.weights + self.gradients + self.optimizer + max(self.activations, self.step_copy)


def memory_per_gpu(model: ModelShape, layout: Layout, optimizer: str = "adamw",
                   gradients: Gradients = FP32_GRADIENTS) -> Memory:
    """16-bit weights, ``gradients.element_bytes`` of accumulated gradients (fp32 by default,
    :data:`GRADIENT_BYTES`) plus an overlapping DDP's bucket copy, :func:`optimizer_bytes_per_parameter`
    of state (18 bytes per parameter in all for AdamW with fp32 gradients; ZeRO's §3.1 count of 16
    plus Megatron's fp32 gradient buffer), :func:`activation_bytes`, and the optimizer step's
    gradient copy (:class:`Gradients`), which peaks when the activations are gone."""
    params = stage_parameters_per_gpu(model, layout)
    bucket = gradients.bucket_bytes if gradients.overlapped(layout) else 0
    d, zero = layout.replicas, gradients.zero
    if zero and optimizer == "onebit_lamb":
        raise ConfigError("--zero: 1-bit LAMB keeps each worker's whole momentum and error buffers (its server error "
                          "is already split); use --zero 0 with onebit_lamb")
    weights = ACTIVATION_BYTES * params
    grads = (gradients.element_bytes + bucket) * params
    optimizer_state = optimizer_bytes_per_parameter(optimizer, d) * params
    if zero >= 1:
        optimizer_state /= d
    if zero == 3:  # at rest 1/d; while a layer runs, its gathered weights and its whole gradient
        layer = layer_parameters_per_gpu(model, layout.tensor)
        weights = weights / d + ACTIVATION_BYTES * layer
        grads = grads / d + gradients.element_bytes * layer
    return Memory(
        weights=weights,
        gradients=grads,
        optimizer=optimizer_state,
        activations=activation_bytes(model, layout),
        step_copy=gradients.step_copy_bytes * params / (d if zero else 1),
    )


# ----------------------------------------------------------------------------------------------
# Communication volume per mesh axis and step, bytes one GPU sends


CONTEXT_EXCHANGES = ("gathered", "ring", "ulysses", "hybrid")  # parallel.context_attention


def ulysses_ranks(context_attention: str, context: int, ulysses_degree: int = 1) -> int:
    """The ranks of one all-to-all group: ``c`` for ``ulysses``, ``ulysses_degree`` for ``hybrid``, 1 for the
    gathered and ring exchanges (which have none)."""
    return {"ulysses": context, "hybrid": ulysses_degree}.get(context_attention, 1)


def context_problem(exchange: str, context: int, ulysses_degree: int, heads: int) -> str | None:
    """Why ``exchange`` cannot split a sequence over ``context`` ranks holding ``heads`` query heads each
    (a tensor rank's), or None. Ulysses gives each rank ``heads/u`` of them whole."""
    if exchange not in CONTEXT_EXCHANGES:
        return f"context_attention must be one of {', '.join(CONTEXT_EXCHANGES)}, got {exchange!r}"
    if exchange == "hybrid" and not (1 < ulysses_degree < context and context % ulysses_degree == 0):
        return f"hybrid needs ulysses_degree (got {ulysses_degree}) between 1 and context={context}, dividing it"
    u = ulysses_ranks(exchange, context, ulysses_degree)
    if heads % u:
        fix = "; use hybrid with a ulysses_degree that divides them" if exchange == "ulysses" else ""
        return f"{exchange} needs the {heads} heads per tensor rank divisible by {u}{fix}"
    return None


def context_exchange_of(model: ModelConfig) -> dict[str, str | int]:
    """A config's ``context_attention`` and ``ulysses_degree`` (hybrid's alone), as :class:`Layout` takes them."""
    hybrid = model.context_attention == "hybrid"
    return {"context_attention": model.context_attention, "ulysses_degree": model.ulysses_degree if hybrid else 1}


def exchange_words(layout: Layout) -> str:
    """How the layout's context ranks exchange, in words (what ``meshtron plan`` prints)."""
    c, u = layout.context, layout.ulysses_degree
    return {"gathered": "keys and values all-gathered",
            "ring": "key/value blocks passed around a ring",
            "ulysses": f"Ulysses: all-to-alls into {c} head groups",
            "hybrid": f"hybrid: Ulysses all-to-alls over {u} ranks, a ring over {c // u}"}[layout.context_attention]


def exchange_wire_bytes(exchange: str, ranks: int, tokens: float, kv_heads: int, head_dim: int, itemsize: int,
                        *, heads: int, ulysses_degree: int = 1) -> tuple[float, float]:
    """``(forward, backward)`` bytes one rank sends over ``context`` per attention layer for ``tokens`` of
    its own, ``heads`` query and ``kv_heads`` key/value heads on its tensor rank: the formula of
    :func:`meshtron.models.context_attention.exchange_bytes` (which imports JAX; the tests hold the two
    equal). ``gathered``: ``(c−1)`` key and value blocks all-gathered forward, their gradients
    reduce-scattered backward. ``ring``: the same forward; backward the blocks again with their fp32
    gradients, and the gradients home. ``ulysses``: four all-to-alls each way, each sending ``(u−1)/u``
    of its array -- queries, keys, values in and the output back (backward: the output's gradient in,
    the three gradients back), key/value heads repeated to ``lcm(k, u)`` when ``u`` does not divide
    them. ``hybrid``: Ulysses's
    over groups of ``u``, then the ring over ``c/u`` groups of the ``S/r`` tokens a group holds, for
    ``1/u`` of the key/value heads."""
    u = ulysses_ranks(exchange, ranks, ulysses_degree)
    if exchange in ("gathered", "ring"):
        block = tokens * kv_heads * head_dim * itemsize
        if exchange == "gathered":
            return (ranks - 1) * 2 * block, (ranks - 1) * 2 * block
        gradients = 2 * tokens * kv_heads * head_dim * 4
        return (ranks - 1) * 2 * block, (ranks - 1) * 2 * block + ranks * gradients
    kv_sent = kv_heads if kv_heads % u == 0 else math.lcm(kv_heads, u)  # repeated until u divides them
    all_to_all = (u - 1) / u * tokens * head_dim * itemsize * (2 * heads + 2 * kv_sent)
    if exchange == "ulysses":
        return all_to_all, all_to_all
    ring_forward, ring_backward = exchange_wire_bytes("ring", ranks // u, tokens * u, kv_sent // u, head_dim,
                                                      itemsize, heads=heads // u)
    return all_to_all + ring_forward, all_to_all + ring_backward


def context_wire_bytes(model: ModelShape, layout: Layout) -> float:
    """Bytes one GPU sends over ``context`` per layer and microbatch with the layout's exchange
    (:func:`exchange_wire_bytes`, which the compiled step matches): one forward's (twice with
    recomputation, which reruns the attention) and the backward's, for the rank's ``b·s/c`` tokens of
    the ``k·d/t`` key/value width (``h/t`` for the GPT; key/value heads ``t`` does not divide are whole
    on every rank), in 16 bits."""
    c = layout.context
    if c == 1:
        return 0.0
    t = layout.tensor
    kv_local = model.kv_heads // t if model.kv_heads % t == 0 else model.kv_heads
    tokens = layout.microbatch * model.seq_len / c
    forward, backward = exchange_wire_bytes(layout.context_attention, c, tokens, kv_local, model.head_dim,
                                            ACTIVATION_BYTES, heads=model.heads // t,
                                            ulysses_degree=layout.ulysses_degree)
    forwards = 1 + (layout.recompute != "none")
    return forwards * forward + backward


def tensor_wire_bytes(model: ModelShape, layout: Layout) -> float:
    """Bytes one GPU sends over ``tensor`` per step: Megatron's all-reduces (four per layer and
    microbatch, six when the forward is recomputed, plus embedding and loss terms; §3.2, 2.3) as
    :func:`meshtron.megatron.megatron_figures` counts them, each a ring's ``2(t−1)/t`` of its size."""
    return ring_wire_bytes("all-reduce", figures(model, layout).tensor_bytes, layout.tensor)


def pipe_wire_bytes(model: ModelShape, layout: Layout) -> float:
    """Bytes one GPU sends over ``pipe`` per step, across nodes: ``b·s·h`` per microbatch and stage
    boundary each way (:func:`meshtron.megatron.megatron_figures`), crossed ``v`` times as often by the
    interleaved schedule (§2.2.2), of which each tensor rank sends ``1/t`` with the scatter/gather
    optimisation (§4.1); the receiver all-gathers the rest over NVLink."""
    return figures(model, layout).pipe_bytes * layout.chunks / layout.tensor


def onebit_padded_length(elements: int, data: int) -> int:
    """1-bit LAMB's buffer length: a multiple of ``P·lcm(P, 8)`` so each of the P chunks packs into
    whole bytes (:func:`meshtron.optim.compression.padded_length`, which imports JAX; the tests hold
    the two equal)."""
    step = data * math.lcm(data, 8)
    return max(step, -(-elements // step) * step)


def data_wire_bytes(parameters: float, data: int, optimizer: str, grad_bytes: int = GRADIENT_BYTES,
                    zero: int = 0, microbatches: int = 1) -> float:
    """Bytes one GPU sends over ``data`` per step: a ring all-reduce of its gradient shard
    (``2(d−1)/d · parameters · grad_bytes``, §3.3; ``parameters`` as
    :func:`meshtron.megatron.megatron_figures`' ``data_bytes`` counts them) for AdamW and LAMB, or
    1-bit LAMB's compressed exchange in its compression stage: one sign bit per (padded) element in
    each of its two phases plus two fp32 scales per peer, ``2(d−1)/d · n/8 + 8(d−1)``
    (:func:`meshtron.optim.compression.compressed_bytes_per_device`). With ``zero=1`` a reduce-scatter
    of the gradients and an all-gather of the 16-bit weights, ``(d−1)/d · parameters · (grad_bytes + 2)``;
    with ``zero=3``, per microbatch, two all-gathers of the 16-bit weights (forward, backward) and a
    reduce-scatter of the gradients. Recomputation adds no third gather: a layer's backward gathers
    its weights once and both its recomputed forward and its gradients use them (meshtron's
    :meth:`meshtron.optim.zero.ZeroPlan.layer_view`; FSDP and DeepSpeed's ZeRO-3 likewise)."""
    if data <= 1:
        return 0.0
    ring = (data - 1) / data
    if zero == 1:
        return ring * parameters * (grad_bytes + ACTIVATION_BYTES)
    if zero == 3:
        return microbatches * ring * parameters * (grad_bytes + 2 * ACTIVATION_BYTES)
    if optimizer == "onebit_lamb":
        padded = onebit_padded_length(math.ceil(parameters), data)
        return 2 * (data - 1) * padded // (8 * data) + 8 * (data - 1)
    return ring_wire_bytes("all-reduce", parameters * grad_bytes, data)
