"""LoRA (Hu et al., 2021) on any contract model: low-rank adapters beside the block matrices, the base
frozen.

**Which parameters.** A block matrix: a parameter of the stacked blocks with two or more axes besides
``layers`` whose first or last axis is the residual width ``embed`` -- every projection into or out of
the residual stream (attention's query/key/value and output, the MLP's). :class:`LoraSpec.targets`
narrows that down by dotted path patterns (``"*attn*"``, ``"blocks.mlp.up.kernel"``) or by logical
axes (``"axis:heads"``: the matrices with a ``heads`` axis).

**The adapters.** A matrix ``W`` read as ``[in..., out...]`` -- ``[embed] x [the rest]`` when ``embed`` comes
first, ``[the rest] x [embed]`` when it comes last -- gets ``A`` ``[layers, in..., r]`` (random, as in the
paper) and ``B`` ``[layers, r, out...]`` (zeros: training starts from the base exactly), NNX parameters
of the module that owns ``W`` (``kernel_lora_a``, ``kernel_lora_b``), with ``W``'s logical axes and one
more, ``lora_rank`` (replicated). So they are laid out like their base -- ``B`` split over ``tensor``
where a column-parallel ``W``'s outputs are, ``A`` where a row-parallel one's inputs are, every layer's
on its pipeline stage -- and checkpoints, schedules and ZeRO see ordinary parameters.

**The forward.** Each layer's parameters pass through :func:`merge_view` before the layer runs (the
contract's :func:`~meshtron.models.contract.layer_parameters` hook, so the model does nothing):
``W + (alpha / r) · A B``, with ``W`` under ``stop_gradient``. The backward reaches ``A`` and ``B``
through the merged matrix: no gradient of the base is formed beyond the merged matrix's own, which
``A`` and ``B``'s gradients are read from (``(alpha / r) · dW Bᵀ`` and ``(alpha / r) · Aᵀ dW``). The
merged matrix is never kept from the forward to the backward (it is recomputed from ``A``, ``B``
and ``W``: :data:`MERGED`), so the activation memory is full fine-tuning's. Adapter dropout on the
layer inputs needs the adapters applied to activations, which a merged weight cannot do: not offered.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtron.errors import ConfigError

RANK_AXIS = "lora_rank"
A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"
MERGED = "lora_merged"  # checkpoint name of a merged matrix: recomputed in the backward, never stored
LAYERS, EMBED = "layers", "embed"


@dataclass(frozen=True)
class LoraSpec:
    """``rank`` r, ``alpha`` (the update is scaled by ``alpha / r``) and ``targets`` (module doc)."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"train.lora.rank: must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ConfigError(f"train.lora.alpha: must be positive, got {self.alpha!r}")
        if not self.targets:
            raise ConfigError("train.lora.targets: empty; give path patterns or axis:NAME (default [\"*\"])")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def chooses(self, path: str, axes: Sequence[str | None]) -> bool:
        """Whether the block matrix ``path`` (dotted, from the model's root) with logical ``axes`` is adapted."""
        for target in self.targets:
            if target.startswith("axis:"):
                if target[5:] in axes:
                    return True
            elif fnmatch.fnmatchcase(path, target):
                return True
        return False


def input_axes(axes: Sequence[str | None]) -> int | None:
    """How many of a block parameter's axes (after ``layers``) are its inputs when read as a matrix
    into or out of the residual stream; ``None`` when it is not one (a bias, a norm's scale)."""
    inner = tuple(axes[1:]) if axes and axes[0] == LAYERS else tuple(axes)
    if len(inner) < 2:
        return None
    if inner[0] == EMBED:
        return 1
    if inner[-1] == EMBED:
        return len(inner) - 1
    return None


def is_adapter(name: str) -> bool:
    """Whether the dotted parameter name is an adapter (``..._lora_a`` / ``..._lora_b``)."""
    return name.endswith((A_SUFFIX, B_SUFFIX))


def with_adapters(factory: Callable[[nnx.Rngs], nnx.Module], spec: LoraSpec) -> Callable[[nnx.Rngs], nnx.Module]:
    """``factory`` whose model carries adapters beside every chosen block matrix (module doc)."""
    from meshtron.sharding import variable_axes

    @functools.wraps(factory)
    def build(rngs: nnx.Rngs) -> nnx.Module:
        model = factory(rngs)
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nnx.Module):
            return model  # the contract check names what is missing
        chosen = 0
        key = rngs.params()
        for path, var in nnx.to_flat_state(nnx.state(blocks, nnx.Param)):
            axes = variable_axes(var)
            name = ".".join(["blocks", *map(str, path)])
            split = input_axes(axes)
            if split is None or is_adapter(name) or not spec.chooses(name, axes):
                continue
            owner = functools.reduce(lambda m, k: m[k] if isinstance(k, int) else getattr(m, k), path[:-1], blocks)
            w = var.get_value()
            layers, ins, outs = w.shape[0], w.shape[1 : 1 + split], w.shape[1 + split :]
            in_axes, out_axes = tuple(axes[1 : 1 + split]), tuple(axes[1 + split :])
            key, sub = jax.random.split(key)
            # A as Kaiming-uniform with a = sqrt(5) (what the paper's code and PEFT use), B zeros
            bound = (1.0 / math.prod(ins)) ** 0.5
            a = jax.random.uniform(sub, (layers, *ins, spec.rank), w.dtype, -bound, bound)
            b = jnp.zeros((layers, spec.rank, *outs), w.dtype)
            setattr(owner, str(path[-1]) + A_SUFFIX, nnx.Param(a, out_sharding=(LAYERS, *in_axes, RANK_AXIS)))
            setattr(owner, str(path[-1]) + B_SUFFIX, nnx.Param(b, out_sharding=(LAYERS, RANK_AXIS, *out_axes)))
            chosen += 1
        if not chosen:
            raise ConfigError(f"train.lora.targets: {list(spec.targets)} choose none of the model's block matrices "
                              "(parameters under blocks with embed as their first or last axis); widen them")
        return model

    return build


def merge_view(spec: LoraSpec) -> Callable[[dict], dict]:
    """One layer's parameters (a pure dict) with every adapted matrix replaced by ``W + (alpha/r)·A B``,
    ``W`` frozen (``stop_gradient``), named :data:`MERGED`."""

    def view(layer: dict) -> dict:
        return _merged(layer, spec.scale, stacked=False, name=MERGED)

    return view


def merged(params: dict, spec: LoraSpec) -> dict:
    """A whole (canonical) parameter tree with the adapters folded into their matrices and removed:
    the plain model, for export and for inference without the adapters' arithmetic."""
    out = dict(params)
    out["blocks"] = _merged(params["blocks"], spec.scale, stacked=True, drop=True)
    return out


def without_adapters(tree: Any) -> Any:
    """A parameter-shaped tree (nested dicts) without its adapters' leaves: the base model's shape."""
    if not isinstance(tree, dict):
        return tree
    return {k: without_adapters(v) for k, v in tree.items() if not (isinstance(k, str) and is_adapter(k))}


def with_adapters_of(base: Any, full: Any) -> Any:
    """``base`` (a tree without adapters) with the adapters of ``full`` added where they belong."""
    if not isinstance(full, dict):
        return base
    return {k: (v if isinstance(k, str) and is_adapter(k) else with_adapters_of(base[k], v)) for k, v in full.items()}


def _merged(tree: Any, scale: float, *, stacked: bool, drop: bool = False, name: str | None = None) -> Any:
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        if isinstance(key, str) and is_adapter(key):
            if not drop:
                out[key] = value
            continue
        a, b = tree.get(f"{key}{A_SUFFIX}"), tree.get(f"{key}{B_SUFFIX}")
        if a is None or b is None:
            out[key] = _merged(value, scale, stacked=stacked, drop=drop, name=name)
            continue
        w = _merge_one(value, a, b, scale, stacked)
        out[key] = w if name is None else checkpoint_name(w, name)
    return out


def _merge_one(w: jax.Array, a: jax.Array, b: jax.Array, scale: float, stacked: bool) -> jax.Array:
    """``W + scale·A B`` (over a leading layer axis when ``stacked``), in ``W``'s dtype."""
    lead = 1 if stacked else 0
    ins = a.ndim - 1 - lead
    letters = "abcdefghijklmnopq"
    l_ = "z" if stacked else ""
    in_ix, out_ix = letters[:ins], letters[ins : ins + b.ndim - 1 - lead]
    delta = jnp.einsum(f"{l_}{in_ix}r,{l_}r{out_ix}->{l_}{in_ix}{out_ix}", a, b)
    return jax.lax.stop_gradient(w) + (scale * delta).astype(w.dtype)
