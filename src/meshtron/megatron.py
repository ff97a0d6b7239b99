"""The papers' figures: what Narayanan et al. (SC21, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM") and Korthikanti et al. (2022, "Reducing Activation Recomputation
in Large Transformer Models") say a step costs -- parameters (eq. 2), FLOPs (eq. 3), bytes per mesh
axis, activation memory (Table 2, and the same model with the constants of meshtron's blocks).

They are held against compiled programs (:mod:`meshtron.hlo`) in the tests and benchmarks, priced
by the planner (:mod:`meshtron.plan`) and printed by ``describe``; the bytes convention is
:mod:`meshtron.hlo.collectives`' (one device's share of a collective's result). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "REMAT_MODES",
    "BlockActivations",
    "MegatronFigures",
    "layer_activation_bytes",
    "megatron_figures",
    "megatron_flops",
    "megatron_params",
    "megatron_stage_activation_bytes",
    "model_flops_per_token",
    "paper_layer_activation_bytes",
    "pipeline_activation_bytes",
]

REMAT_MODES = ("none", "full", "selective")
"""Activation recomputation: ``none``, ``full`` (every layer's input kept, the layer recomputed)
or ``selective`` (the attention core recomputed), as ``model.remat`` names them."""


@dataclass(frozen=True)
class MegatronFigures:
    """Analytical model size, FLOPs and per-device communication of one training step.

    Byte figures follow this module's convention -- per-device *result-shape* bytes, summed over
    the step, the same quantity as :attr:`Collective.total_bytes` -- so they can be compared
    directly with :func:`bytes_by_axes` of a compiled step. Tensor-parallel figures are for one
    device and cover all its microbatches; the embedding and loss terms are paid by the first and
    last pipeline stage (both on every device when ``pipe == 1``).
    """

    params: int
    flops_per_iteration: int
    flops_per_iteration_no_remat: int
    microbatch_size: int
    layers_per_stage: int
    tensor_allreduces_per_layer: int
    tensor_layer_allreduces: int
    tensor_allreduce_bytes: int
    tensor_layer_bytes: int
    tensor_embedding_bytes: int
    tensor_loss_bytes: int
    pipe_bytes: int
    data_bytes: int

    @property
    def tensor_bytes(self) -> int:
        return self.tensor_layer_bytes + self.tensor_embedding_bytes + self.tensor_loss_bytes

    @property
    def bytes_by_axes(self) -> dict[tuple[str, ...], int]:
        """The same keys :func:`bytes_by_axes` produces for a (data, pipe, tensor) mesh."""
        return {("data",): self.data_bytes, ("pipe",): self.pipe_bytes, ("tensor",): self.tensor_bytes}


def model_flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Model FLOPs of one training token: ``6·N + 12·l·h·s`` (Chowdhery et al., PaLM, appendix B:
    a multiply-add per parameter in the forward and two in the backward, plus the attention scores
    and their product with the values, ``6·l·h·s`` forward-and-backward each); recomputation is not
    counted (model FLOPs, not hardware FLOPs). The figure behind logged FLOP/s and utilisation."""
    return 6.0 * params + 12.0 * layers * hidden * seq_len


def megatron_params(*, vocab_size: int, hidden: int, layers: int, seq_len: int) -> int:
    """Parameters of the paper's GPT, eq. 2 of Narayanan et al. (SC21):
    ``12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`` = ``12lh² + 13lh + (V+s)h`` -- per layer the QKV,
    projection and two MLP matrices (12h²) with their biases and two layer norms (13h), plus the
    word and position embeddings. The one copy of the formula (:func:`megatron_figures` and
    :mod:`meshtron.plan` call it)."""
    V, h, l, s = vocab_size, hidden, layers, seq_len  # the paper's symbols
    return 12 * l * h * h + 13 * l * h + (V + s) * h


def megatron_flops(*, vocab_size: int, hidden: int, layers: int, seq_len: int, global_batch: int,
                   recompute: str = "full") -> int:
    """FLOPs of one iteration (GEMMs only), eq. 3 of Narayanan et al. (SC21) and its appendix.

    A layer's forward costs ``24·B·s·h² + 4·B·s²·h`` (QKV 6, projection 2, MLP 16 ·Bsh²; scores and
    their product with the values 2 ·Bs²h each); the backward twice that; the LM head ``2·B·s·h·V``
    forward and twice that backward, never recomputed. ``recompute``: ``full`` runs every layer's
    forward again (eq. 3 as printed, ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``); ``selective``
    (Korthikanti et al. 2022) only the attention core's ``4·B·s²·h``; ``none`` nothing
    (``72·B·s·l·h²·(1 + s/(6h)) + 6·B·s·h·V``)."""
    if recompute not in REMAT_MODES:
        raise ValueError(f"recompute must be one of {', '.join(REMAT_MODES)}, got {recompute!r}")
    V, h, l, s, B = vocab_size, hidden, layers, seq_len, global_batch  # the paper's symbols
    passes = {"none": 3, "selective": 3, "full": 4}[recompute]  # forward-equivalents of the layers
    attention = 4 * B * s * s * l * h * (passes + (recompute == "selective"))
    return passes * 24 * B * s * l * h * h + attention + 6 * B * s * h * V


def megatron_figures(
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    seq_len: int,
    heads: int,
    global_batch: int,
    data: int,
    pipe: int,
    tensor: int,
    microbatches: int,
    remat: bool,
    bytes_per_element: int = 4,
    layers_per_stage: int | None = None,
) -> MegatronFigures:
    """Figures from Narayanan et al. (SC21) for a GPT with the given shape and parallel layout.

    ``layers_per_stage``: the most layers one pipeline stage runs, for an uneven
    ``parallel.layout``; by default ``layers / pipe``, which must then be whole.

    * ``params`` -- eq. 2: 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)), i.e. 12lh^2 + 13lh + (V+s)h.
    * ``flops_per_iteration`` -- eq. 3, which assumes full activation recomputation (four passes
      of the forward cost): 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)).
      ``flops_per_iteration_no_remat`` drops the recomputed forward: 72*B*s*l*h^2*(1 + s/(6h)) +
      6*B*s*h*V (the LM head is never recomputed in either).
    * Tensor parallelism (Megatron's f/g operators): per layer two all-reduces forward (after
      attention and after the MLP) and two backward, plus two more when the forward is recomputed,
      each of one microbatch's activations b*s*h. The vocab-parallel embedding adds a forward
      all-reduce and the LM head's input gradient a backward one (b*s*h each); the vocab-parallel
      cross-entropy all-reduces the max, the target logit and the sum of exponentials (b*s each).
    * Pipeline: one activation forward and one gradient backward per microbatch per stage boundary.
    * Data parallelism: one all-reduce of the local gradient shard, params/(tensor*pipe) elements.

    ``heads`` does not enter the paper's formulas; it is validated so an impossible layout fails
    here rather than at compile time.
    """
    for name, value in (
        ("vocab_size", vocab_size), ("hidden", hidden), ("layers", layers), ("seq_len", seq_len),
        ("heads", heads), ("global_batch", global_batch), ("data", data), ("pipe", pipe),
        ("tensor", tensor), ("microbatches", microbatches), ("bytes_per_element", bytes_per_element),
    ):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if global_batch % (data * microbatches):
        raise ValueError(
            f"global_batch={global_batch} is not divisible by data*microbatches={data * microbatches}"
        )
    if layers % pipe and layers_per_stage is None:
        raise ValueError(f"layers={layers} is not divisible by pipe={pipe}")
    if hidden % heads or heads % tensor:
        raise ValueError(
            f"need hidden % heads == 0 and heads % tensor == 0, got {hidden=}, {heads=}, {tensor=}"
        )

    shape = {"vocab_size": vocab_size, "hidden": hidden, "layers": layers, "seq_len": seq_len}
    params = megatron_params(**shape)
    flops = megatron_flops(**shape, global_batch=global_batch, recompute="full")
    flops_no_remat = megatron_flops(**shape, global_batch=global_batch, recompute="none")

    b, s, h = global_batch // (data * microbatches), seq_len, hidden
    layers_per_stage = layers // pipe if layers_per_stage is None else layers_per_stage
    activation_bytes = b * s * h * bytes_per_element
    tensor_parallel = tensor > 1
    per_layer = (6 if remat else 4) if tensor_parallel else 0
    layer_allreduces = microbatches * layers_per_stage * per_layer
    return MegatronFigures(
        params=params,
        flops_per_iteration=flops,
        flops_per_iteration_no_remat=flops_no_remat,
        microbatch_size=b,
        layers_per_stage=layers_per_stage,
        tensor_allreduces_per_layer=per_layer,
        tensor_layer_allreduces=layer_allreduces,
        tensor_allreduce_bytes=activation_bytes if tensor_parallel else 0,
        tensor_layer_bytes=layer_allreduces * activation_bytes,
        tensor_embedding_bytes=microbatches * 2 * activation_bytes if tensor_parallel else 0,
        tensor_loss_bytes=microbatches * 3 * b * s * bytes_per_element if tensor_parallel else 0,
        pipe_bytes=2 * microbatches * activation_bytes if pipe > 1 else 0,
        data_bytes=round(params * bytes_per_element / (tensor * pipe)) if data > 1 else 0,
    )


# --------------------------------------------------------------------------------------------------
# Activation memory (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models", Table 2), and the same model with the constants of meshtron's blocks
# --------------------------------------------------------------------------------------------------

def _check_activation_args(seq_len: int, microbatch: int, hidden: int, heads: int, tensor: int,
                           remat: str) -> None:
    for name, value in (("seq_len", seq_len), ("microbatch", microbatch), ("hidden", hidden), ("heads", heads),
                        ("tensor", tensor)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if remat not in REMAT_MODES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_MODES)}, got {remat!r}")


def paper_layer_activation_bytes(*, seq_len: int, microbatch: int, hidden: int, heads: int, tensor: int = 1,
                                 sequence_parallel: bool = False, remat: str = "none") -> float:
    """Activation bytes one transformer layer keeps for its backward pass -- Korthikanti et al., Table 2,
    verbatim (GPT block, fp16 activations, 1-byte dropout masks):

    * no parallelism ``s·b·h·(34 + 5·a·s/h)``; tensor parallel ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``;
    * tensor + sequence parallel ``s·b·h·(34 + 5·a·s/h)/t``;
    * selective recomputation drops the ``5·a·s/h`` attention-core term (``s·b·h·34/t`` with SP);
    * full recomputation keeps the layer input only: ``2·s·b·h`` (``/t`` with SP).
    """
    _check_activation_args(seq_len, microbatch, hidden, heads, tensor, remat)
    s, b, h, a, t = seq_len, microbatch, hidden, heads, tensor
    if remat == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    core = 0.0 if remat == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h * (34 + core) / t
    return s * b * h * (10 + 24 / t + core / t)


@dataclass(frozen=True)
class BlockActivations:
    """What one block keeps for its backward pass, per token, in elements: the constants of Table 2
    for a given block (the paper's are bytes at fp16 with dropout; these are elements).

    Outside the tensor-parallel regions every tensor rank holds the residual-width arrays:
    ``residual`` of them (norm inputs, their centred/normalized values, residual sums) are the ones
    sequence parallelism splits over the sequence; ``gathered`` are the norm outputs the regions
    take whole (the all-gathered input of the column-parallel projections, kept for their weight
    gradients). Inside the regions everything is split over ``tensor``: ``query`` arrays the width
    of the query heads (``heads·head_dim``), ``key_value`` arrays the width of the key/value heads,
    ``mlp`` arrays the width of the MLP, and ``scores`` per-head ``[s, s]`` arrays (attention logits
    and probabilities) -- the only term selective recomputation drops.

    Each built-in family states its block's (``BLOCK`` in its counts module, :mod:`meshtron.families`).
    The ``gathered`` norm outputs that sequence parallelism leaves whole are a choice: Megatron-LM keeps
    them split and all-gathers them again for the weight gradients (two more all-gathers per layer
    backward); meshtron keeps them gathered, so the tensor traffic stays exactly that of the all-reduces
    it replaces.
    """

    residual: float
    gathered: float
    query: float
    key_value: float
    mlp: float
    scores: float


def layer_activation_bytes(*, seq_len: int, microbatch: int, hidden: int, heads: int, block: BlockActivations,
                           kv_heads: int | None = None, mlp_dim: int | None = None, tensor: int = 1,
                           sequence_parallel: bool = False, remat: str = "none", bytes_per_element: int = 4) -> float:
    """Activation bytes one layer keeps for its backward pass, per device: Table 2 adapted to ``block``
    (a family's ``BLOCK``, :mod:`meshtron.families`).

    ``s·b·((R + G)·h + (Q·h + KV·h·k/a + M·f + S·a·s)/t)`` elements (``R``, ``G``, ``Q``, ``KV``,
    ``M``, ``S`` the fields of :class:`BlockActivations`; ``k`` key/value heads, replicated on every
    tensor rank when ``t`` does not divide them, as the rules do); sequence parallelism divides the
    ``R`` term by ``t`` too; ``selective`` drops the ``S`` term; ``full`` keeps the layer input,
    ``s·b·h`` (``/t`` with SP).
    """
    _check_activation_args(seq_len, microbatch, hidden, heads, tensor, remat)
    s, b, h, a, t = seq_len, microbatch, hidden, heads, tensor
    k = kv_heads or heads
    f = mlp_dim or 4 * hidden
    residual = h / (t if sequence_parallel else 1)
    if remat == "full":
        return s * b * residual * bytes_per_element
    kv_split = t if k % t == 0 else 1
    inside = (block.query * h + block.mlp * f) / t + block.key_value * h * k / a / kv_split
    if remat == "none":
        inside += block.scores * a * s / t
    return s * b * (block.residual * residual + block.gathered * h + inside) * bytes_per_element


def pipeline_activation_bytes(*, layer_bytes: float, input_bytes: float, layers_per_chunk: int,
                              in_flight: int) -> float:
    """Activation bytes per device under meshtron's pipeline runtime, for one step.

    The runtime keeps only each in-flight microbatch's *stage input* (``input_bytes``: ``s·b·h``
    elements, ``/t`` with sequence parallelism) in its stash -- ``in_flight`` is the schedule's
    ``stash_slots`` -- and recomputes a virtual stage from it at its backward tick, which holds one
    chunk's activations (``layers_per_chunk`` × ``layer_bytes``, the model's own remat mode) at a
    time. Megatron's runtime instead keeps every in-flight microbatch's layer activations:
    :func:`megatron_stage_activation_bytes`.
    """
    return in_flight * input_bytes + layers_per_chunk * layer_bytes


def megatron_stage_activation_bytes(*, layer_bytes: float, layers_per_stage: int, in_flight: int) -> float:
    """Activation bytes on a pipeline stage that keeps each in-flight microbatch's layer activations
    (Megatron-LM; Korthikanti et al. §4.2.3: with 1F1B the first stage holds ``p`` microbatches, so its
    total is ``L/p · p`` = ``L`` layers' worth): ``in_flight × layers_per_stage × layer_bytes``."""
    return in_flight * layers_per_stage * layer_bytes
