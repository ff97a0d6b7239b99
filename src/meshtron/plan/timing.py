"""How long one training step of a layout takes on a cluster, term by term.

The paper gives no cost model for time (§3: "we do not present direct cost models for
communication time"), so this one is assembled from its counts and the cluster's datasheet:

* compute: every GEMM of a layer (§5.1's appendix) at the cluster's GEMM efficiency for its
  smallest dimension, plus the memory-bound element-wise kernels (layer norms, fused bias-GeLU,
  bias-dropout-add and scale-mask-softmax, attention dropout; §4.2) at the achieved HBM bandwidth;
* tensor parallelism: the all-reduces of :func:`meshtron.plan.model.figures`, exposed (Megatron-LM
  of 2021 waits for each before the next GEMM), over NVLink when ``t`` fits in a node;
* pipeline: one exchange after every chunk's forward and one after its backward (Megatron's fused
  send/receive pairs), ``b·s·h/t`` per GPU over its NIC and an NVLink all-gather (§4.1), exposed;
  the last stage, which also runs the LM head, sets the pace of the ``m`` microbatches, and the
  bubble ``(p−1)/(v·m)`` (§2.2) is the fill and drain the *other* stages run, so it is priced
  without the head;
* host: the program's idle GPU time around every forward and backward step of a chunk
  (:attr:`~meshtron.plan.cluster.Cluster.step_overhead_us`: Megatron-LM of 2021 synchronises the
  device around each step and each exchange), in the steady state and in the bubble alike;
* data parallelism: one gradient all-reduce per step after the last backward, *not* overlapped
  (Megatron-LM of 2021's ``local`` DDP; :class:`~meshtron.plan.model.Gradients` says when an
  implementation hides it, and in how many bits it travels), or 1-bit LAMB's compressed exchange;
  then the optimizer's memory-bound update.

Beyond the paper's GPT with full recomputation: the Llama family's GEMMs and kernels (grouped-query
attention's narrower key/value projections, SwiGLU's three matrices, an untied head), selective
recomputation (only the attention core runs again; Korthikanti et al. 2022) and sequence parallelism
(the norm, residual and dropout kernels on ``s/t`` of the tokens, each all-reduce a reduce-scatter
plus an all-gather of the same bytes, the pipeline's message kept split), and the zero levels (the
exchange of :func:`meshtron.plan.model.data_wire_bytes`, the update of a ``1/d`` share).

Throughput is reported the paper's way: eq. 3's FLOPs (with recomputation, whatever the layout
recomputes) per second per GPU. Every :class:`Estimate` names the model that priced it
(``priced_by``: ``analytical``, this module's terms), so that other pricings of the same layout can
stand beside it in one ranking.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from meshtron.plan.cluster import Cluster
from meshtron.plan.model import (
    ACTIVATION_BYTES,
    FP32_GRADIENTS,
    Gradients,
    Layout,
    Memory,
    ModelShape,
    context_wire_bytes,
    data_wire_bytes,
    figures,
    flops_per_iteration,
    memory_per_gpu,
    onebit_padded_length,
    stage_parameters_per_gpu,
)

__all__ = [
    "ELEMENTWISE_PASSES",
    "LLAMA_ELEMENTWISE_PASSES",
    "OPTIMIZER_PASSES",
    "Estimate",
    "allreduce_seconds",
    "alltoall_seconds",
    "bubble_fraction",
    "data_seconds",
    "estimate",
    "host_seconds",
    "layer_gemm_seconds",
    "layer_gemms",
    "layer_memory_seconds",
    "logits_seconds",
    "optimizer_seconds",
    "p2p_seconds",
    "recompute_seconds",
    "tensor_seconds",
]

ELEMENTWISE_PASSES = {"residual": (11.0, 17.0), "mlp": (2.0, 3.0), "scores": (4.5, 5.5)}
"""(forward, backward) 16-bit elements one layer reads and writes outside its GEMMs, per token and
unit of width, counted from Megatron's fused layer (§4.2); a byte of dropout mask is half an element.
``residual`` (×h, on every tensor rank): forward two layer norms (read, write: 2 each) and two fused
bias-dropout-adds (read two, write one, mask: 3.5 each); backward the layer norms (read input and
gradient, write: 3 each), the dropouts (read gradient and mask, write: 2.5 each) and the two
residual-gradient sums (read two, write one: 3 each). ``mlp`` (×4h/t): fused bias-GeLU forward
(read, write) and backward (read input and gradient, write). ``scores`` (×a·s/t): fused
scale-mask-softmax (read, write; backward read output and gradient, write) and attention dropout
(read, write, mask; backward read gradient and mask, write). Counts, not fitted."""

LLAMA_ELEMENTWISE_PASSES = {"residual": (10.0, 12.0), "rope": (2.0, 2.0), "mlp": (3.0, 5.0), "scores": (2.0, 3.0)}
"""The same counts for the Llama block as Megatron-LM fuses it, without dropout: ``residual`` (×h)
forward two RMSNorms (read, write: 2 each) and two residual adds (read two, write one: 3 each),
backward the norms (read input and gradient, write: 3 each) and the residual-gradient sums (3 each);
``rope`` (×(h + k·d)/t, the queries and keys) rotary embedding forward (read, write) and backward
(read gradient, write); ``mlp`` (×f/t) fused SwiGLU forward (read gate and up, write) and backward
(read gate, up and gradient, write both gradients); ``scores`` (×a·s/t) the fused scale-mask-softmax
(read, write; backward read output and gradient, write)."""

OPTIMIZER_PASSES = {"adamw": 30.0, "lamb": 38.0, "onebit_lamb": 50.0}
"""Bytes an optimizer step reads and writes per parameter: AdamW reads the fp32 gradient, rewrites
the fp32 master weight and two moments, writes the 16-bit weight (4 + 24 + 2); LAMB reads the update
and the weight again for the per-layer trust ratio (+8); 1-bit LAMB (compression stage) also
rewrites v̂ and the worker error (+16) and only reads the frozen variance (−4)."""


# ----------------------------------------------------------------------------------------------
# Compute


def layer_gemms(model: ModelShape, layout: Layout) -> list[tuple[float, float]]:
    """(FLOPs, smallest dimension) of every GEMM one transformer layer runs on one GPU for one
    microbatch, over all passes: the forward of eq. 3's appendix split by tensor parallelism (§2.3)
    -- QKV ``[bs, h]·[h, 3h/t]``, projection ``[bs, h/t]·[h/t, h]``, MLP ``[bs, h]·[h, 4h/t]`` and
    ``[bs, 4h/t]·[4h/t, h]``, and per head ``[s, d]·[d, s]`` scores and ``[s, s]·[s, d]`` context --
    with the backward's two GEMMs each (same dimensions, twice the FLOPs) and the recomputed
    forward: all of it with ``full`` recomputation, the attention core with ``selective``
    (Korthikanti et al. 2022: its two GEMMs once more, nothing else).

    The Llama block: the fused QKV GEMM is ``[h, (a + 2k)·d/t]`` (grouped-query attention's
    ``k`` key/value heads; a rank computes all ``k`` when ``t`` does not divide them, as their
    weights are then whole), SwiGLU's gate and up fused ``[h, 2f/t]`` and its down ``[f/t, h]``."""
    b, s, h, t = layout.microbatch, model.seq_len, model.hidden, layout.tensor
    tokens, heads, d = b * s // layout.context, model.heads / t, model.head_dim  # (a context rank's s/c queries)
    dense_passes = 3 + (layout.recompute == "full")
    attention_passes = 3 + (layout.recompute in ("full", "selective"))
    k, f = model.kv_heads, model.mlp_dim
    qkv = model.heads * d + 2 * k * d * (1 if k % t == 0 else t)  # t x the columns a rank computes
    up = f * (2 if model.family != "gpt" else 1)  # SwiGLU's gate and up, fused
    dense = [
        (2 * tokens * h * qkv / t, min(tokens, h, qkv / t)),
        (2 * tokens * h / t * h, min(tokens, h / t, h)),
        (2 * tokens * h * up / t, min(tokens, h, up / t)),
        (2 * tokens * f / t * h, min(tokens, f / t, h)),
    ]
    attention = [(2 * tokens * heads * s * d, min(s // layout.context, d))] * 2
    return ([(flops * dense_passes, dim) for flops, dim in dense]
            + [(flops * attention_passes, dim) for flops, dim in attention])


def layer_gemm_seconds(model: ModelShape, layout: Layout, cluster: Cluster) -> float:
    """Σ FLOPs / (peak × GEMM efficiency(smallest dimension)) over :func:`layer_gemms`."""
    peak = cluster.peak_tflops * 1e12
    return sum(flops / (peak * cluster.gemm(dim)) for flops, dim in layer_gemms(model, layout))


def layer_memory_seconds(model: ModelShape, layout: Layout, cluster: Cluster,
                         passes: dict[str, tuple[float, float]] | None = None,
                         element_bytes: int = ACTIVATION_BYTES) -> float:
    """Element-wise kernels of one layer and microbatch on one GPU: :data:`ELEMENTWISE_PASSES` of
    16-bit elements (:data:`LLAMA_ELEMENTWISE_PASSES` for the Llama family), the forward twice where
    it is recomputed (all of it with ``full``, the ``scores`` terms with ``selective``), at the
    achieved HBM bandwidth; with sequence parallelism each tensor rank runs the ``residual`` kernels
    on ``s/t`` of the tokens (Korthikanti et al. 2022, §4.2.2). ``passes`` and ``element_bytes``
    price another runtime's kernels (``benchmarks/calibration.py``: meshtron's, fp32 and without
    dropout)."""
    if passes is None:
        passes = ELEMENTWISE_PASSES if model.family == "gpt" else LLAMA_ELEMENTWISE_PASSES
    b, s, h, t = layout.microbatch, model.seq_len, model.hidden, layout.tensor
    tokens = b * s / layout.context
    residual = tokens * h / (t if layout.sequence_parallel else 1)
    widths = {"residual": residual, "mlp": tokens * model.mlp_dim / t, "scores": tokens * model.heads / t * s}
    if "rope" in passes:
        widths["rope"] = tokens * (h + model.kv_heads * model.head_dim) / t
    recomputed = {"full": set(widths), "selective": {"scores"}, "none": set()}[layout.recompute]
    elements = sum(width * (forward * (1 + (name in recomputed)) + backward)
                   for name, width in widths.items() for forward, backward in [passes[name]])
    return elements * element_bytes / (cluster.hbm_gbps * 1e9 * cluster.memory_efficiency)


def logits_seconds(model: ModelShape, layout: Layout, cluster: Cluster) -> float:
    """The LM head on the last stage, one microbatch: ``[bs, h]·[h, V/t]`` forward and its two
    backward GEMMs (``6·b·s·h·V/t``, eq. 3's last term), never recomputed."""
    b, s, h, t = layout.microbatch, model.seq_len // layout.context, model.hidden, layout.tensor
    dim = min(b * s, h, model.vocab_size / t)
    return 6 * b * s * h * model.vocab_size / t / (cluster.peak_tflops * 1e12 * cluster.gemm(dim))


# ----------------------------------------------------------------------------------------------
# Communication


def allreduce_seconds(nbytes: float, group: int, per_node: int, cluster: Cluster) -> float:
    """A ring all-reduce of ``nbytes`` over ``group`` GPUs, ``per_node`` of them in each node:
    ``2(g−1)/g · nbytes / bandwidth + 2(g−1) · latency`` (§3.3: the ring's ``(d−1)/d`` scaling).

    Inside one node the bandwidth is one GPU's NVLink; across nodes the ring leaves every node once,
    and the node's NICs are shared by the ``gpus_per_node/per_node`` groups that run at the same time
    (every GPU is in one), so each group gets ``per_node/gpus_per_node`` of them -- all eight HCAs
    for a ring of whole nodes, one for a ring with one GPU per node."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (group - 1)
    nvlink = cluster.nvlink_gbps * 1e9 * cluster.nvlink_efficiency
    if group <= per_node:
        return steps / group * nbytes / nvlink + steps * cluster.nvlink_latency_us * 1e-6
    network = cluster.network_gbps * 1e9 * cluster.network_efficiency * per_node / cluster.gpus_per_node
    return steps / group * nbytes / min(nvlink, network) + steps * cluster.network_latency_us * 1e-6


def tensor_seconds(model: ModelShape, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """(per layer, LM head and loss) seconds of tensor-parallel all-reduces for one microbatch: the
    layer's four (six with full recomputation) of ``b·s·h`` (§2.3, §3.2), and on the last stage the
    LM head's input-gradient all-reduce (plus the embedding's with ``p = 1``) and the loss's three
    of ``b·s`` fp32 values (:func:`meshtron.megatron.megatron_figures`). Sequence parallelism turns
    each all-reduce into a reduce-scatter and an all-gather of the same bytes (Korthikanti et al.
    2022, §4.2.2): a ring all-reduce is exactly those two, so the time is the same."""
    t = layout.tensor
    if t == 1:
        return 0.0, 0.0
    fig = figures(model, layout)
    per_node = min(t, cluster.gpus_per_node)
    c = layout.context  # a context rank's activations hold s/c of the sequence
    one = allreduce_seconds(fig.tensor_allreduce_bytes / c, t, per_node, cluster)
    small = allreduce_seconds(layout.microbatch * model.seq_len / c * 4, t, per_node, cluster)
    head = one * (2 if layout.pipe == 1 else 1) + 3 * small
    return fig.tensor_allreduces_per_layer * one, head


def p2p_seconds(model: ModelShape, layout: Layout, cluster: Cluster) -> float:
    """Pipeline exchanges of one microbatch on one stage: ``2v`` of them (after each chunk's forward
    and backward; the send and the receive of a fused pair go opposite ways at once). Each sends
    ``b·s·h/t`` 16-bit values per GPU -- over its NIC when the pipeline spans nodes (Megatron puts
    consecutive stages ``t·d`` ranks apart), else over NVLink -- and all-gathers ``b·s·h`` over the
    ``t`` ranks on NVLink (the scatter/gather optimisation, §4.1). With sequence parallelism the
    stage boundary is already split over the sequence: the ``1/t`` is sent and kept, no all-gather."""
    if layout.pipe == 1:
        return 0.0
    t = layout.tensor
    message = layout.microbatch * model.seq_len / layout.context * model.hidden * ACTIVATION_BYTES
    if layout.gpus > cluster.gpus_per_node:
        send = message / t / (cluster.nic_gbps * 1e9 * cluster.network_efficiency) + cluster.network_latency_us * 1e-6
    else:
        send = message / t / (cluster.nvlink_gbps * 1e9 * cluster.nvlink_efficiency) + cluster.nvlink_latency_us * 1e-6
    gather = 0.0
    if t > 1 and not layout.sequence_parallel:
        gather = ((t - 1) / t * message / (cluster.nvlink_gbps * 1e9 * cluster.nvlink_efficiency)
                  + (t - 1) * cluster.nvlink_latency_us * 1e-6)
    return 2 * layout.chunks * (send + gather)


def context_seconds(model: ModelShape, layout: Layout, cluster: Cluster) -> float:
    """One layer's key/value all-gathers over ``context`` (and their reduce-scatters backward) for one
    microbatch (:func:`meshtron.plan.model.context_wire_bytes`): context ranks are ``t`` apart (the
    mesh puts tensor innermost, context next), ``gpus_per_node/t`` of them in a node; each collective
    is priced as half a ring all-reduce of the bytes it gathers."""
    c = layout.context
    if c == 1:
        return 0.0
    per_node = min(c, max(1, cluster.gpus_per_node // layout.tensor))
    sent = context_wire_bytes(model, layout)
    collectives = 2 * (2 + (layout.recompute != "none"))  # keys and values, in each forward and the backward
    one = sent / collectives  # the bytes one all-gather (or reduce-scatter) sends
    return collectives * allreduce_seconds(one * c / (c - 1), c, per_node, cluster) / 2


def alltoall_seconds(nbytes: float, group: int, per_node: int, cluster: Cluster) -> float:
    """An all-to-all of ``nbytes`` per GPU over ``group`` GPUs, ``per_node`` of them in each node:
    each GPU sends ``(g−1)/g`` of its buffer, one piece per peer. Inside a node all of it goes over
    NVLink; across nodes the ``(g − per_node)/g`` bound for other nodes leaves through the GPU's
    own NIC (every GPU of a node runs its own group's all-to-all at once, so none borrows another's)
    while the rest crosses NVLink at the same time, with ``g−1`` latencies."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    nvlink = cluster.nvlink_gbps * 1e9 * cluster.nvlink_efficiency
    if group <= per_node:
        return (group - 1) / group * nbytes / nvlink + (group - 1) * cluster.nvlink_latency_us * 1e-6
    nic = cluster.nic_gbps * 1e9 * cluster.network_efficiency
    off_node = (group - per_node) / group * nbytes / nic
    on_node = (per_node - 1) / group * nbytes / nvlink
    return max(off_node, on_node) + (group - 1) * cluster.network_latency_us * 1e-6


def data_seconds(model: ModelShape, layout: Layout, cluster: Cluster, optimizer: str,
                 gradients: Gradients = FP32_GRADIENTS) -> float:
    """The step's data-parallel exchange of one GPU's gradient shard (``params/(t·p)`` values,
    :func:`meshtron.megatron.megatron_figures`' ``data_bytes``): a ring all-reduce of
    ``gradients.element_bytes`` per value (fp32 by default), or 1-bit
    LAMB's compressed exchange in its compression stage (Li et al. 2021, Algorithm 1;
    :mod:`meshtron.optim.compression`): an all-to-all of the packed sign bits (``n/8`` bytes of the
    padded length, :func:`meshtron.plan.model.onebit_padded_length`) to the workers that own each
    chunk, then a ring all-gather of the server chunks' signs (half an all-reduce of ``n/8``).
    Data-parallel peers are ``t`` ranks apart (Megatron's rank order), so ``gpus_per_node/t`` of
    them share a node. With ``gradients.zero`` the exchange is reduce-scatters and all-gathers
    (:func:`meshtron.plan.model.data_wire_bytes`), priced as ring all-reduces of the same bytes."""
    d = layout.replicas  # data x context: each context rank's gradient covers its own tokens
    if d == 1:
        return 0.0
    parameters = figures(model, layout).data_bytes / ACTIVATION_BYTES
    per_node = min(d, max(1, cluster.gpus_per_node // layout.tensor))
    if gradients.zero:  # reduce-scatters and all-gathers: a ring moves half an all-reduce's bytes in each
        sent = data_wire_bytes(parameters, d, optimizer, gradients.element_bytes, gradients.zero, layout.microbatches)
        return allreduce_seconds(sent * d / (2 * (d - 1)), d, per_node, cluster)
    if optimizer != "onebit_lamb":
        return allreduce_seconds(parameters * gradients.element_bytes, d, per_node, cluster)
    signs = onebit_padded_length(math.ceil(parameters), d) / 8
    gather = allreduce_seconds(signs / 2, d, per_node, cluster)  # a ring all-gather: half the all-reduce's traffic
    return alltoall_seconds(signs, d, per_node, cluster) + gather


def optimizer_seconds(model: ModelShape, layout: Layout, cluster: Cluster, optimizer: str,
                      zero: int = 0) -> float:
    """The optimizer's element-wise update of one GPU's parameters: :data:`OPTIMIZER_PASSES` bytes
    per parameter at the achieved HBM bandwidth; with ``zero`` >= 1 each data rank updates its
    ``1/d`` share (the optimizer state it holds)."""
    params = stage_parameters_per_gpu(model, layout) / (layout.replicas if zero else 1)
    return params * OPTIMIZER_PASSES[optimizer] / (cluster.hbm_gbps * 1e9 * cluster.memory_efficiency)


def recompute_seconds(model: ModelShape, layout: Layout, cluster: Cluster) -> float:
    """One layer's recomputation for one microbatch on one GPU: what its GEMMs, element-wise kernels,
    tensor all-reduces and key/value exchanges cost beyond the same layout without recomputation --
    the whole forward with ``full``, the attention core (its two GEMMs and the softmax) with
    ``selective``."""
    if layout.recompute == "none":
        return 0.0
    bare = dataclasses.replace(layout, recompute="none")

    def layer(lay: Layout) -> float:
        return (layer_gemm_seconds(model, lay, cluster) + layer_memory_seconds(model, lay, cluster)
                + tensor_seconds(model, lay, cluster)[0] + context_seconds(model, lay, cluster))

    return layer(layout) - layer(bare)


def host_seconds(layout: Layout, cluster: Cluster) -> float:
    """The GPU's idle time of one microbatch on one stage between steps: a forward and a backward
    step per chunk (``2v``), each costing the cluster's ``step_overhead_us`` -- with or without
    pipelining, since Megatron-LM's timers synchronise around every step either way."""
    return 2 * layout.chunks * cluster.step_overhead_us * 1e-6


def bubble_fraction(pipe: int, microbatches: int, chunks: int = 1) -> float:
    """Idle time over ideal time of a flushed pipeline: ``(p−1)/m`` for 1F1B (§2.2.1) and
    ``(p−1)/(v·m)`` interleaved (§2.2.2)."""
    return (pipe - 1) / (chunks * microbatches)


# ----------------------------------------------------------------------------------------------
# The step


@dataclass(frozen=True)
class Estimate:
    """A layout's predicted step on a cluster. ``seconds`` holds the step's terms (they add up to
    ``step_seconds``); ``tflops_per_gpu`` is eq. 3's FLOPs over the step time and GPU count."""

    layout: Layout
    optimizer: str
    step_seconds: float
    tflops_per_gpu: float
    bubble: float
    memory: Memory
    seconds: dict[str, float] = field(default_factory=dict)
    data_bytes: float = 0.0  # bytes one GPU sends over `data` per step with this optimizer
    warmup_seconds: float | None = None  # 1-bit LAMB: a warmup step (uncompressed exchange); else the step
    recompute_seconds: float = 0.0  # of the step, what recomputation costs (in gemm, elementwise, tensor, bubble)
    priced_by: str = "analytical"  # the time model that priced it: this module's, term by term

    def run_seconds(self, freeze_fraction: float = 0.16) -> float:
        """Mean step over a run: 1-bit LAMB spends ``freeze_fraction`` of its steps in the
        uncompressed warmup (``optim.freeze_step``, 16% by default), the rest compressed."""
        if self.warmup_seconds is None:
            return self.step_seconds
        return freeze_fraction * self.warmup_seconds + (1 - freeze_fraction) * self.step_seconds

    @property
    def communication_share(self) -> float:
        """Exposed tensor, pipeline and data-parallel communication over the step time."""
        return (self.seconds["tensor"] + self.seconds.get("context", 0.0) + self.seconds["pipe"]
                + self.seconds["data"]) / self.step_seconds

    @property
    def data_share(self) -> float:
        return self.seconds["data"] / self.step_seconds


def estimate(model: ModelShape, layout: Layout, cluster: Cluster, optimizer: str = "adamw",
             gradients: Gradients = FP32_GRADIENTS) -> Estimate:
    """Predict one step: ``m · t_last + (p−1)/v · (t_last − t_head) + t_data + t_optimizer``, with
    ``t_last`` one microbatch's time through the last stage's ``l/p`` layers -- GEMMs, element-wise
    kernels and tensor all-reduces per layer, the LM head and its all-reduces (``t_head``), the
    pipeline exchanges, the host's step overheads. The ``(p−1)/v`` extra stage-times are the bubble
    (§2.2, eq. 1 with interleaving): the first microbatch's forward through, and the last one's
    backward back from, the ``p−1`` stages before the last, which have no head (the paper's
    formula, which charges every stage the slowest one's time, overprices it when the head weighs,
    e.g. one layer per stage). ``t_data`` is zero when the all-reduce is hidden
    (``gradients.overlapped(layout)``)."""
    layout.check(model)
    stage_layers = model.layers // layout.pipe
    tensor_layer, tensor_head = tensor_seconds(model, layout, cluster)
    head = logits_seconds(model, layout, cluster)
    per_microbatch = {
        "gemm": stage_layers * layer_gemm_seconds(model, layout, cluster) + head,
        "elementwise": stage_layers * layer_memory_seconds(model, layout, cluster),
        "tensor": stage_layers * tensor_layer + tensor_head,
        "context": stage_layers * context_seconds(model, layout, cluster),
        "pipe": p2p_seconds(model, layout, cluster),
        "host": host_seconds(layout, cluster),
    }
    m, p, v = layout.microbatches, layout.pipe, layout.chunks
    bubble = bubble_fraction(p, m, v)
    seconds = {name: value * m for name, value in per_microbatch.items()}
    seconds["bubble"] = (sum(per_microbatch.values()) - head - tensor_head) * (p - 1) / v
    hidden = gradients.overlapped(layout)
    seconds["data"] = 0.0 if hidden else data_seconds(model, layout, cluster, optimizer, gradients)
    seconds["optimizer"] = optimizer_seconds(model, layout, cluster, optimizer, gradients.zero)
    step = sum(seconds.values())
    warmup = None
    if optimizer == "onebit_lamb":  # its warmup exchanges the gradients uncompressed, as LAMB does
        warmup = step - seconds["data"] + (0.0 if hidden else data_seconds(model, layout, cluster, "lamb", gradients))
    parameters = figures(model, layout).data_bytes / ACTIVATION_BYTES
    return Estimate(
        layout=layout, optimizer=optimizer, step_seconds=step,
        tflops_per_gpu=flops_per_iteration(model, layout.global_batch) / step / layout.gpus / 1e12,
        bubble=bubble, memory=memory_per_gpu(model, layout, optimizer, gradients), seconds=seconds,
        data_bytes=data_wire_bytes(parameters, layout.replicas, optimizer, gradients.element_bytes, gradients.zero,
                                   layout.microbatches),
        warmup_seconds=warmup,
        recompute_seconds=stage_layers * recompute_seconds(model, layout, cluster) * (m + (p - 1) / v),
    )
