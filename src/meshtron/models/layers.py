"""What the built-in families share: initializers that attach logical axis names to their parameter,
and the pre-norm residual block body."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.models.blocks import RESIDUAL, Context, enter_parallel_region, exit_parallel_region
from meshtron.models.cast_weights import recording
from meshtron.models.collective_matmul import GATHERED_INPUT, column_parallel
from meshtron.models.fp8 import joined_weight, projection_einsum
from meshtron.models.master_weight_gemm import fusing, joined_master_einsum, master_weight_einsum
from meshtron.sharding import LogicalAxes, constrain
from meshtron.trace_context import current

INIT_STD = 0.02


def normal(std: float, axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.normal(std), axes)


def zeros(axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.zeros_init(), axes)


def ones(axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.ones_init(), axes)


def padded_vocab_init(vocab_size: int, std: float = INIT_STD):
    """N(0, std) rows for the real vocabulary and zero rows for Megatron's padding, axes (vocab, embed).

    Padded rows get no gradient (their logits are masked, their ids never looked up), so at zero
    they stay inert under AdamW and LAMB; and the real rows are drawn at ``[vocab_size, hidden]``,
    so one seed gives the same model whatever padding the tensor-parallel size asks for.
    """

    def init(key: jax.Array, shape: tuple[int, int], dtype=jnp.float32) -> jax.Array:
        real = nnx.initializers.normal(std)(key, (vocab_size, shape[1]), dtype)
        return jnp.pad(real, ((0, shape[0] - vocab_size), (0, 0)))

    return nnx.with_partitioning(init, ("vocab", "embed"))


def fused_projection(spec: str, x: jax.Array, fuse: Callable[..., jax.Array], *kernels: jax.Array,
                     axes: LogicalAxes | None = None,
                     parts: tuple[Callable[[jax.Array], Sequence[jax.Array]], Sequence[str]] | None = None) -> jax.Array:
    """``einsum(spec, x, fuse(*kernels))`` whose backward pass rebuilds the fused kernel instead of keeping it.

    Fusing kernels (query/key/value, gate/up) makes one matmul, so the backward pass all-reduces one
    input gradient as Megatron's fused projections do; but the joined kernel is a new array, and
    autodiff would keep a copy of it per layer for the backward pass -- a second copy of the block's
    weights next to its activations. Under ``jax.checkpoint`` only ``x`` and the kernels themselves
    (parameters, kept anyway) are saved; the join is redone in the backward pass, the matmul is not
    (a linear map's transpose needs only its operands).

    Under ``model.fp8`` nothing is recomputed: the FP8 GEMM keeps its operands' float8 bytes, not the
    joined kernel, and the rerun would quantize the joined kernel again
    (:func:`~meshtron.models.fp8.joined_weight`: one quantization, of the shares where a layer view gathers).
    FP8 and collective matmul are exclusive (the run's check rejects the pair).

    ``axes``: the joined kernel's logical axes, for a column-parallel projection in a tensor-parallel
    region: under collective matmul it then gathers a sequence-split ``x`` itself
    (:func:`meshtron.models.collective_matmul.column_parallel`).

    ``parts``: ``(split, specs)``, how the joined output cuts into the kernels' own outputs (``split(y)[i]
    = einsum(specs[i], x, kernels[i])``). Under ``parallel.gradient_accumulation_fusion`` each kernel's
    float32 weight gradient is then a GEMM of its own (:func:`~meshtron.models.master_weight_gemm.
    joined_master_einsum`), which XLA adds into that kernel's accumulator.
    """
    if current().fp8 != "off":
        return projection_einsum(spec, x, joined_weight(fuse, kernels, x.dtype), projections=len(kernels))
    product = projection_einsum if axes is None else column_parallel(axes)
    # what a collective matmul gathers is kept (:data:`GATHERED_INPUT`), as the gathered x is without one
    policy = jax.checkpoint_policies.save_only_these_names(GATHERED_INPUT)

    def project(x, *kernels):
        if fusing() and not current().collective_matmul:
            # float32 weight gradients, one GEMM per kernel where ``parts`` says how to cut the output
            if parts is not None:
                return joined_master_einsum(spec, x, fuse, kernels, *parts)
            return master_weight_einsum(spec, x, fuse(*kernels))
        return product(spec, x, fuse(*kernels).astype(x.dtype), projections=len(kernels))

    if recording():  # the weights a pipeline stage casts once per step, recorded in this trace; nothing differentiates it
        return project(x, *kernels)
    return jax.checkpoint(project, policy=policy, prevent_cse=False)(x, *kernels)


def projection_kernel(module: Any) -> jax.Array:
    """The matrix of a projection module that a fused projection joins with others: ``module.kernel[...]``;
    for a module a layer hook has wrapped to add a term to its output (LoRA's adapters on the activations:
    :func:`meshtron.models.contract.layer_parameters`), the wrapped module's own matrix
    (``module.fused_kernel``). A model that joins matrices into one matmul reads them this way and then adds
    each module's term with :func:`with_added_output`, so the hook's term is kept without the model knowing
    what the hook is."""
    return module.fused_kernel if hasattr(module, "added_output") else module.kernel[...]


def with_added_output(module: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """``y`` (``module``'s part of a fused projection of ``x``, from :func:`projection_kernel`) plus what a
    hook-wrapped module adds to its output (``module.added_output(x, dtype)``); ``y`` for a plain module."""
    added = getattr(module, "added_output", None)
    return y if added is None else y + added(x, y.dtype)


def pre_norm_block(x: jax.Array, ctx: Context, attn_norm: Callable, attn: Callable, mlp_norm: Callable,
                   mlp: Callable):
    """``x + attn(attn_norm(x))``, then ``+ mlp(mlp_norm(.))``; ``(x, cache)`` when ``attn`` decodes with
    ``ctx.cache`` (it then returns its output and the layer's new cache).

    Norms run on the residual stream's layout (:data:`~meshtron.models.blocks.RESIDUAL`: split over
    the sequence under sequence parallelism) and their outputs enter the tensor-parallel regions
    whole (:func:`~meshtron.models.blocks.enter_parallel_region`); each region's output is summed
    back into the stream (:func:`~meshtron.models.blocks.exit_parallel_region`: an all-reduce, or a
    reduce-scatter under sequence parallelism). The regions' projections are column- and row-parallel
    einsums (:mod:`meshtron.models.collective_matmul`): under collective matmul they do the gather and
    the reduce-scatter themselves, overlapped with their GEMMs, and the entries and exits none."""
    attended = attn(enter_parallel_region(attn_norm(x), collective=True), ctx)
    attended, cache = attended if ctx.cache is not None else (attended, None)
    x = constrain(x + exit_parallel_region(attended, collective=True), RESIDUAL)
    mixed = mlp(enter_parallel_region(mlp_norm(x), collective=True))
    x = constrain(x + exit_parallel_region(mixed, collective=True), RESIDUAL)
    return x if cache is None else (x, cache)
