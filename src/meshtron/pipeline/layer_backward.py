"""A stage's backward taken one layer at a time from each layer's ``jax.vjp`` residuals: what the
runtime runs for split-backward (zero-bubble) schedules and whenever the forward keeps its residuals
instead of recomputing (:class:`LayerBackward`). The per-layer cut itself is
:mod:`meshtron.pipeline.split_backward`.

The weight gradient W always reads the layers' residuals, so B leaves it only what depends on the
output gradient: kept residuals (``parallel.recompute=false``) live in the microbatch's residual slot
until W; recomputing, W reruns the chunk's forward from the stashed stage input (which the program
keeps until W) to get them -- one more chunk forward per W, the price of recomputation, for a
B-to-W buffer without the activations W multiplies (Llama: 2h + (a+2k)d/t + 2f/t elements per token
per layer, the projections' output cotangents, instead of 4h + (a+2k)d/t + h/t + 3f/t with their inputs)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshtron.pipeline.buffers import accumulate, chunk_of, get, put
from meshtron.pipeline.program import Program
from meshtron.pipeline.split_backward import SplitPullback, residuals
from meshtron.pipeline.stage import PyTree, StageFunctions

__all__ = ["FUSED_ATTENTION_PRIMITIVES", "LayerBackward", "kept_residuals_policy"]


FUSED_ATTENTION_PRIMITIVES = ("dot_product_attention_fwd", "dot_product_attention_fwd_wrapper")
"""JAX's cuDNN fused attention forward (``jax.nn.dot_product_attention(implementation="cudnn")``): the primitive
and the wrapper it is bound through."""


def kept_residuals_policy(prim, *args, **params) -> bool:
    """What a layer keeps from its forward to its backward when nothing is recomputed: the outputs of its
    matrix products (``dots_saveable``) and of fused attention kernels (:data:`FUSED_ATTENTION_PRIMITIVES`),
    whose backward kernel reads the forward's output and softmax statistics. Under ``dots_saveable`` alone the
    backward reruns the attention forward kernel to get them: on Llama-2 70B pipelined over 64 H100s
    (2 x 8 x 4) that is 79 ms of an 8.4 s step's GEMM time (docs/gpu.md). It keeps them under
    ``model.remat=selective`` too, whose checkpoint around the attention core would keep nothing: with a fused
    kernel there are no ``[s, s]`` probabilities to spare, only the output and one statistic per query row."""
    return jax.checkpoint_policies.dots_saveable(prim, *args, **params) or prim.name in FUSED_ATTENTION_PRIMITIVES


def _compiling_for() -> str:
    """The platform of the devices the program being traced is for: the current mesh's (``jax.set_mesh``:
    compile-only GPU devices on a CPU machine are GPUs), else JAX's default backend. Weight gradients
    run on operands laid out as a plain GEMM reads them on CPUs and GPUs (:class:`SplitPullback`'s
    ``contiguous_weight_matmuls``: XLA:CPU's fast GEMM; on H100 programs the estimated step is shorter,
    benchmarks/2026-12-01-gradient-accumulation-fusion.md), with the product behind a barrier on CPUs
    only: on GPUs the barrier would keep XLA from adding the product into its accumulator in the GEMM."""
    from jax._src import mesh as mesh_lib  # no public accessor for the concrete mesh set by jax.set_mesh

    mesh = mesh_lib.get_concrete_mesh()
    if mesh is None or mesh.empty:
        return jax.default_backend()
    platform = mesh.devices.flat[0].platform
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


class LayerBackward:
    """A stage's backward taken one layer at a time, from each layer's ``jax.vjp`` residuals.

    Used by split-backward (zero-bubble) schedules and whenever the forward keeps its residuals
    instead of recomputing. Built once per program from the first layer of chunk 0 (every layer of
    a uniform stack has the same pullback): ``layers_forward`` runs a chunk keeping each layer's
    residuals as its outputs (the recomputing B); ``forward_into`` writes them into a slot of the
    residual buffers instead; ``backward_into`` walks the layers back through their whole
    pullbacks, adding each layer's parameter gradients to the accumulator it carries;
    ``input_gradient_into`` computes only the input gradient and writes per layer what the weight
    gradient will need into a slot of the B-to-W buffers, from which ``weight_gradient_into``
    computes the weight gradients, in any later tick, reading the layers' residuals again (kept, or
    recomputed by ``forward_weight_gradient_into``). Every buffer is carried through the layer loop
    and updated in place, one layer's slice at a time.

    ``weights``: what the model prepared for the step (:attr:`StageFunctions.prepare`, stacked ``[chunks,
    layers, ...]``): each layer runs with its own slice, which its pullback reads where it lives, as it
    reads the parameters, instead of storing it among the residuals.
    """

    def __init__(self, program: Program, fns: StageFunctions, stage_params: PyTree, example_x: jax.Array,
                 example_tokens: jax.Array, pin: Callable[[jax.Array], jax.Array], zeros: Callable[[PyTree], PyTree],
                 weights: PyTree = None):
        if fns.layer is None:
            why = ("splits the backward per layer" if program.schedule.split_backward
                   else "keeps each layer's residuals (no recomputation)")
            raise ValueError(f"schedule {program.schedule.name!r} {why}: "
                             "StageFunctions.layer (one layer of a chunk) is required")
        self._layer, self._pin, self._zeros, self._weights = fns.layer, pin, zeros, weights
        if program.keeps_layer_residuals and fns.remat in ("full", "offload") and not program.schedule.split_backward:
            # Full recomputation: a layer keeps its input alone, and its pullback reruns its forward
            # (Megatron's ``--recompute-granularity full``). ``offload`` keeps it so too: the residual
            # slots are the runtime's own device buffers. A split backward's W reads the kept
            # matmul inputs, so zero-bubble schedules keep those (below) whatever ``model.remat``.
            self._layer = jax.checkpoint(fns.layer, policy=jax.checkpoint_policies.nothing_saveable)
        elif program.keeps_layer_residuals:
            # What a layer keeps from its forward to its backward: the matmul outputs. Everything
            # elementwise (norms, GELU/SiLU, softmax) is recomputed from them in the backward, as XLA
            # does when a forward and its backward are one program: jax.vjp's own residuals keep every
            # intermediate (GELU's tanh pieces, ...), 4x the bytes, and moving those through the
            # residual buffers costs more time than recomputing them.
            # A fused attention kernel's outputs (its output and softmax statistics) are kept too: its
            # backward kernel reads them, and recomputing them would run the forward kernel again.
            self._layer = jax.checkpoint(fns.layer, policy=kept_residuals_policy)
        first = jax.tree.map(lambda a: a[0, 0], stage_params)  # chunk 0, layer 0
        first_weights = jax.tree.map(lambda a: a[0, 0], weights)
        self._layers = jax.tree.leaves(stage_params)[0].shape[1]
        self._example_x = jax.ShapeDtypeStruct(example_x.shape, example_x.dtype)
        # A layer reads its microbatch's tokens (positions, packed documents) as a closed-over value:
        # what its backward needs of them is then among its residuals, like any other.
        y, stored, treedef, self._slots = residuals(self._with_tokens(example_tokens, first_weights), first, example_x,
                                                    jax.tree.leaves(first_weights))
        self._stored_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in stored]
        # W reads the residuals -- kept ones, which live until W (the program frees their slot there),
        # or, recomputing, those of the chunk's forward W reruns from the stashed input (which lives
        # until W) -- rather than B storing the activations W multiplies: B leaves W only what depends
        # on the cotangent (GPT: 9 of the 26 s·b·h per layer).
        # On CPU, W's matmuls (and the same matmuls in an unsplit backward from kept residuals) get
        # operands XLA's fast GEMM accepts (W 15% faster at width 256) and produce the gradient in
        # the weight's own layout where that copies less (16% more at width 256, 43% at 1024); GPU
        # GEMMs read transposed operands as they are, so elsewhere the pullback is JAX's own.
        platform = _compiling_for()
        self._pullback = SplitPullback(treedef, self._slots, stored, self._read(first, first_weights), y,
                                       weight_reads_residuals=True,
                                       contiguous_weight_matmuls=platform in ("cpu", "gpu"),
                                       weight_product_barrier=platform == "cpu")
        # A boundary value with a home (a residual of its shape that only B reads) is written over
        # that residual in the microbatch's residual slot, which lives until W anyway; the B-to-W
        # buffers hold the others. GPT: the QKV cotangent takes the QKV output's place (9 -> 6 s·b·h).
        # Recomputed residuals live within a tick: nothing has a home there.
        self._homes = (self._pullback.boundary_homes if program.keeps_residuals
                       else (None,) * len(self._pullback.boundary_avals))
        # Parameter gradients B computes itself (a norm's scale and bias) go to the
        # accumulator at B, not through the B-to-W buffers.
        self._at_b = self._pullback.boundary_gradients
        self._to_w = [k for k, (home, g) in enumerate(zip(self._homes, self._at_b))
                      if home is None and g is None]  # boundary index per B-to-W buffer

    def _with_tokens(self, tokens: jax.Array, weights: PyTree = None) -> Callable[[PyTree, jax.Array], jax.Array]:
        if weights is None:
            return lambda layer_params, x: self._layer(layer_params, x, tokens)
        return lambda layer_params, x: self._layer(layer_params, x, tokens, weights)

    @staticmethod
    def _read(layer_params: PyTree, weights: PyTree) -> list[jax.Array]:
        """What a layer's pullback reads where it lives: its parameters, then its prepared weights."""
        return [*jax.tree.leaves(layer_params), *jax.tree.leaves(weights)]

    def _chunk_weights(self, chunk: jax.Array) -> PyTree:
        return None if self._weights is None else chunk_of(self._weights, chunk)

    def _residuals(self, layer_params: PyTree, x: jax.Array, tokens: jax.Array,
                   weights: PyTree = None) -> tuple[jax.Array, list[jax.Array]]:
        y, stored, _, slots = residuals(self._with_tokens(tokens, weights), layer_params, x, jax.tree.leaves(weights))
        if slots != self._slots:  # a layer whose pullback differs from the first one's
            raise ValueError("split backward: the layers of a chunk must share one structure "
                             f"(residuals that are parameters: {slots} vs {self._slots})")
        return self._pin(y), stored

    def _scan(self, step, init, xs, active, skip, reverse=False):
        """``lax.scan(step, init, xs)`` over a chunk's layer slots; with ``active``, slots from
        ``active`` on (an uneven chunk's padding) run ``skip`` instead, which passes the carry
        through and outputs zeros."""
        if active is None:
            return jax.lax.scan(step, init, xs, reverse=reverse)
        layers = jax.tree.leaves(xs)[0].shape[0]

        def maybe(carry, indexed):
            i, x = indexed
            return jax.lax.cond(i < active, lambda: step(carry, x), lambda: skip(carry, x))

        return jax.lax.scan(maybe, init, (jnp.arange(layers), xs), reverse=reverse)

    def layers_forward(self, chunk_params: PyTree, x: jax.Array, tokens: jax.Array,
                       active: jax.Array | None = None, chunk: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array]]:
        return self._scan(lambda h, layer: self._residuals(layer[0], h, tokens, layer[1]), x,
                          (chunk_params, self._chunk_weights(chunk)), active,
                          lambda h, layer: (h, self._zeros(self._stored_avals)))

    def _walk(self, step, carry, chunk_params: PyTree, active: jax.Array | None, chunk: jax.Array,
              reverse: bool = False):
        """``carry = step(carry, i, layer_params, layer_weights)`` for each layer slot ``i`` of a chunk (the
        last first with ``reverse``); with ``active``, slots from ``active`` on (an uneven chunk's padding)
        are skipped. What a layer produces goes into buffers the carry holds, so a skipped slot costs
        nothing (no zeros to output).

        The slot index is a counter the loop carries (XLA sees an induction variable), not an element
        of a scanned ``arange``: XLA:GPU then reads and writes a slot of the carried buffers in place
        around a GEMM (a dynamic-slice fusion), which lets a weight gradient's GEMM add itself into its
        slot of the accumulator (``parallel.gradient_accumulation_fusion``)."""
        def body(c, xs):
            c, i = c
            lp, lw = xs
            following = i - 1 if reverse else i + 1
            if active is None:
                return (step(c, i, lp, lw), following), None
            return (jax.lax.cond(i < active, lambda: step(c, i, lp, lw), lambda: c), following), None

        first = jnp.asarray(self._layers - 1 if reverse else 0, jnp.int32)
        xs = (chunk_params, self._chunk_weights(chunk))
        return jax.lax.scan(body, (carry, first), xs, reverse=reverse)[0][0]

    def forward_into(self, chunk_params: PyTree, x: jax.Array, tokens: jax.Array, active: jax.Array | None,
                     buffers: list[jax.Array], slot: jax.Array, chunk: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """The chunk's forward on the microbatch of ``tokens``, each layer's residuals written to
        ``buffers[j][slot, layer]``."""
        def step(c, i, lp, lw):
            h, bufs = c
            y, stored = self._residuals(lp, h, tokens, lw)
            return y, [put(b, (slot, i), v) for b, v in zip(bufs, stored)]

        return self._walk(step, (x, list(buffers)), chunk_params, active, chunk)

    def backward_into(self, chunk_params: PyTree, residual_of: Callable[[jax.Array], list[jax.Array]],
                      dy: jax.Array, active: jax.Array | None, g_stage: PyTree,
                      chunk: jax.Array) -> tuple[jax.Array, PyTree]:
        """The layers' whole pullbacks, last layer first, from ``residual_of(layer)``: the input
        gradient, and each layer's parameter gradients added to ``g_stage[chunk, layer]``."""
        def step(c, i, lp, lw):
            d, g = c
            flat, dx = self._pullback.pullback(residual_of(i), self._read(lp, lw), d)
            return self._pin(dx), accumulate(g, (chunk, i), flat)

        return self._walk(step, (dy, g_stage), chunk_params, active, chunk, reverse=True)

    def input_gradient_into(self, chunk_params: PyTree, residual_of: Callable[[jax.Array], list[jax.Array]],
                            dy: jax.Array, active: jax.Array | None, buffers: list[jax.Array], slot: jax.Array,
                            g_stage: PyTree, chunk: jax.Array,
                            kept: tuple[list[jax.Array], jax.Array] | None = None,
                            ) -> tuple[jax.Array, tuple[list[jax.Array], list[jax.Array], PyTree]]:
        """B: the input gradient, last layer first; what each layer's weight gradient will need is
        written to ``buffers[j][slot, layer]``, and the parameter gradients B computes itself are
        added to ``g_stage[chunk, layer]``. With ``kept = (residual_buffers, residual_slot)`` the
        residuals are read from those buffers, which the walk carries, and the boundary values that
        have a home there are written over it (see ``__init__``). Returns ``(dx, (buffers,
        residual_buffers, g_stage))`` updated."""
        def step(c, i, lp, lw):
            d, bufs, rbufs, g = c
            res = residual_of(i) if kept is None else [get(b, (kept[1], i)) for b in rbufs]
            dx, boundary = self._pullback.input_gradient(res, self._read(lp, lw), d)
            if kept is not None:
                rbufs = list(rbufs)
                for value, home in zip(boundary, self._homes):
                    if home is not None:
                        rbufs[home] = put(rbufs[home], (kept[1], i), value)
            at_b = [None] * len(jax.tree.leaves(g))
            for value, k in zip(boundary, self._at_b):
                if k is not None:
                    at_b[k] = value
            if any(v is not None for v in at_b):
                g = accumulate(g, (chunk, i), at_b)
            return self._pin(dx), [put(b, (slot, i), boundary[k]) for b, k in zip(bufs, self._to_w)], rbufs, g

        dx, bufs, rbufs, g_stage = self._walk(
            step, (dy, list(buffers), [] if kept is None else list(kept[0]), g_stage), chunk_params, active, chunk,
            reverse=True)
        return dx, (bufs, rbufs, g_stage)

    def _layer_weight_gradient(self, g: PyTree, i: jax.Array, lp: PyTree, lw: PyTree, res: list[jax.Array],
                               buffers: list[jax.Array], slot: jax.Array, chunk: jax.Array) -> PyTree:
        """Layer ``i``'s parameter gradients from its residuals ``res`` and what its B left in
        ``buffers[j][slot, i]``, added to ``g[chunk, i]``."""
        boundary: list = [None] * len(self._homes)  # None: a gradient B has accumulated
        for b, k in zip(buffers, self._to_w):
            boundary[k] = get(b, (slot, i))
        for k, home in enumerate(self._homes):
            if home is not None:
                boundary[k] = res[home]
        flat = self._pullback.weight_gradient(self._read(lp, lw), boundary, res)
        return accumulate(g, (chunk, i), flat)

    def weight_gradient_into(self, chunk_params: PyTree, buffers: list[jax.Array], slot: jax.Array,
                             active: jax.Array | None, g_stage: PyTree, chunk: jax.Array,
                             kept: tuple[list[jax.Array], jax.Array]) -> PyTree:
        """W from kept residuals: each layer's parameter gradients from what its B left in
        ``buffers[j][slot, layer]`` and from the forward's residuals in ``kept = (residual_buffers,
        residual_slot)``, added to ``g_stage[chunk, layer]``."""
        def step(g, i, lp, lw):
            res = [get(b, (kept[1], i)) for b in kept[0]]
            return self._layer_weight_gradient(g, i, lp, lw, res, buffers, slot, chunk)

        return self._walk(step, g_stage, chunk_params, active, chunk)

    def forward_weight_gradient_into(self, chunk_params: PyTree, x: jax.Array, tokens: jax.Array,
                                     buffers: list[jax.Array], slot: jax.Array, active: jax.Array | None,
                                     g_stage: PyTree, chunk: jax.Array) -> PyTree:
        """W recomputing: the chunk's forward rerun from its input ``x`` (the microbatch of ``tokens``),
        each layer's parameter gradients computed from its recomputed residuals as soon as they exist
        (one layer's residuals live at a time) and from what its B left in ``buffers[j][slot,
        layer]``, added to ``g_stage[chunk, layer]``."""
        def step(c, i, lp, lw):
            h, g = c
            y, res = self._residuals(lp, h, tokens, lw)
            return y, self._layer_weight_gradient(g, i, lp, lw, res, buffers, slot, chunk)

        return self._walk(step, (x, g_stage), chunk_params, active, chunk)[1]

    def _stacked(self, avals: list, slots: int | None) -> list[jax.ShapeDtypeStruct]:
        lead = (self._layers,) if slots is None else (max(slots, 1), self._layers)
        return [jax.ShapeDtypeStruct((*lead, *a.shape), a.dtype) for a in avals]

    def _kept(self, slots: int | None) -> list[jax.ShapeDtypeStruct]:
        """Every layer's residuals, then the chunk's output (the head's input on the last stage)."""
        lead = () if slots is None else (max(slots, 1),)
        x = self._example_x
        return [*self._stacked(self._stored_avals, slots), jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype)]

    def buffers(self, slots: int) -> list[jax.Array]:
        """The B-to-W buffers: ``slots`` chunks' boundary values per stage (those without a home in
        the residual slot)."""
        avals = self._pullback.boundary_avals
        return self._zeros(self._stacked([avals[k] for k in self._to_w], slots))

    def residual_buffers(self, slots: int) -> list[jax.Array]:
        """The forward-to-backward buffers when nothing is recomputed: ``slots`` chunks' residuals."""
        return self._zeros(self._kept(slots))
