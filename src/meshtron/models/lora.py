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

**The forward.** Each block passes through :func:`adapter_hook` before it runs (the contract's
:func:`~meshtron.models.blocks.layer_parameters` hook, so the model does nothing). A matrix applied
by an ``nnx.Linear`` or ``nnx.Einsum`` gets its adapters on the activations, ``base(x) + (alpha / r)
· (x A) B``, with the base matrix under ``stop_gradient``: the backward forms no gradient of the base
matrix at all -- only ``x``'s, and the adapters' from the rank-``r`` products -- and adapter dropout
(:func:`adapter_dropout`) drops the adapters' inputs as PEFT does. A matrix the model reads itself (a
raw parameter in its own ``einsum``) is replaced by ``W + (alpha / r) · A B`` instead, ``W`` under
``stop_gradient``, and the adapters' gradients are read from the merged matrix's; that merged matrix is
never kept from the forward to the backward (:data:`MERGED`: recomputed), and dropout cannot apply
to it (one line says so).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtron.config import LoraConfig
from meshtron.errors import ConfigError
from meshtron.trace_context import LayerView, current, using

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
    dropout: float = 0.0  # of the adapters' inputs, in training (:func:`adapter_dropout`)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"train.lora.rank: must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ConfigError(f"train.lora.alpha: must be positive, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"train.lora.dropout: must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ConfigError("train.lora.targets: empty; give path patterns or axis:NAME (default [\"*\"])")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    # ---- the model adaptation (meshtron.models.adaptation.Adaptation) ----

    def wrap(self, factory: Callable[[nnx.Rngs], nnx.Module]) -> Callable[[nnx.Rngs], nnx.Module]:
        return with_adapters(factory, self)

    def layer_view(self) -> LayerView:
        return LayerView(None, MERGED, adapter_hook(self))

    def trains(self, name: str) -> bool:
        return is_adapter(name)

    def training(self, seed: int) -> contextlib.AbstractContextManager:
        return adapter_dropout(self.dropout, seed) if self.dropout > 0 else contextlib.nullcontext()

    def merged(self, params: Any) -> Any:
        return merged(params, self)

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
            full_rank = min(math.prod(ins), math.prod(outs))
            if spec.rank > full_rank:  # the update A B could be no richer than the matrix itself
                raise ConfigError(f"train.lora.rank: {spec.rank} is above the rank of {name} ({math.prod(ins)} x "
                                  f"{math.prod(outs)} per layer: {full_rank}); use a rank of at most {full_rank}, or "
                                  "train the whole model (train.lora.rank=0)")
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


@contextlib.contextmanager
def adapter_dropout(rate: float, seed: int) -> Iterator[None]:
    """Inside this (the train step's gradients), adapters applied to activations drop their inputs with
    probability ``rate`` (kept ones scaled by ``1 / (1 - rate)``), as PEFT's ``lora_dropout`` does.

    The masks are drawn from ``seed``, a hash of the block's input (which is what activation
    recomputation keeps, or recomputes exactly) and the matrix's place in the block: different for
    every layer, microbatch, data rank and step, the same in a layer's forward and its recomputation,
    and no random state to carry, checkpoint or split over pipeline stages. Evaluation and generation
    run outside it: no dropout."""
    with using(dropout=(float(rate), int(seed))):
        yield


def adapter_hook(spec: LoraSpec) -> Callable[[nnx.Module, jax.Array | None], None]:
    """A :func:`~meshtron.models.blocks.layer_parameters` hook applying ``spec``'s adapters to one block.

    A matrix that is the ``kernel`` of an ``nnx.Linear`` or ``nnx.Einsum`` (whose equation contracts
    exactly the matrix's input axes) gets its adapters on the activations: the module is replaced by
    an :class:`AdaptedProjection`, ``y = base(x) + (alpha/r)·(drop(x) A) B`` with the base frozen, so no
    gradient of the base matrix is formed at all and adapter dropout applies. Any other adapted
    matrix (a raw parameter the model reads itself) is replaced by ``W + (alpha/r)·A B`` (named
    :data:`MERGED`: recomputed in the backward, never kept); its adapters' gradients come from the
    merged matrix's, and dropout cannot apply to it."""

    def hook(block: nnx.Module, x: jax.Array | None) -> None:
        rate, seed = current().dropout
        salt = _input_hash(x) if rate > 0 and x is not None else jnp.uint32(0)
        index = 0
        for path, owner in list(nnx.iter_graph(block)):
            if not isinstance(owner, nnx.Module) or isinstance(owner, AdaptedProjection):
                continue
            for attr in sorted(vars(owner)):
                if not attr.endswith(A_SUFFIX):
                    continue
                name = attr[: -len(A_SUFFIX)]
                w, a, b = (getattr(owner, n) for n in (name, attr, name + B_SUFFIX))
                equation = _activation_equation(owner, name, a[...].ndim - 1)
                if equation is None or not path:
                    if current().reference_rows:
                        where = ".".join(["blocks", *map(str, path), name])
                        raise ConfigError(f"train.objective: dpo in a pipeline runs the frozen reference on rows of "
                                          f"their own, and {where} is a matrix the model reads itself (its adapters "
                                          "merged into it, for every row); use parallel.pipe=1 or narrow "
                                          "train.lora.targets to the matrices of nnx.Linear or nnx.Einsum modules")
                    if rate > 0:
                        where = ".".join(["blocks", *map(str, path), name])
                        raise ConfigError(f"train.lora.dropout: is {rate}, and {where} is a matrix the model reads "
                                          "itself (not the kernel of an nnx.Linear or nnx.Einsum it calls), so its "
                                          "adapters are merged into it and cannot drop inputs; set "
                                          "train.lora.dropout=0 or narrow train.lora.targets")
                    w.set_value(checkpoint_name(_merge_one(w.get_value(), a[...], b[...], spec.scale, False), MERGED))
                    continue
                parent = functools.reduce(lambda m, k: m[k] if isinstance(k, int) else getattr(m, k), path[:-1], block)
                adapted = AdaptedProjection(owner, name, a[...], b[...], spec.scale, equation, rate,
                                            jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), salt), index))
                index += 1
                if isinstance(path[-1], int):
                    parent[path[-1]] = adapted
                else:
                    object.__setattr__(parent, path[-1], adapted)  # (a plain object, not an NNX attribute)

    return hook


def _policy_rows(added: jax.Array) -> jax.Array:
    """What the adapters add, kept on the policy's rows alone: zero on the second half of the batch's rows
    when those are a frozen reference's (``reference_rows`` of the trace context)."""
    if not current().reference_rows:
        return added
    rows = added.shape[0]
    keep = (jnp.arange(rows) < rows // 2).reshape(rows, *(1,) * (added.ndim - 1))
    return jnp.where(keep, added, jnp.zeros((), added.dtype))


class AdaptedProjection:
    """An ``nnx.Linear`` / ``nnx.Einsum`` of a block with its adapters on the activations:
    ``base(x) + (alpha/r) · (drop(x) A) B``, the base's matrix under ``stop_gradient``.

    Everything else reads through to the base module. Reading ``kernel`` itself (a model that fuses
    projections by joining their matrices) gives the merged matrix, which is exact without dropout;
    with dropout that read is refused in one line, since the dropped inputs would be skipped."""

    def __init__(self, base: nnx.Module, name: str, a: jax.Array, b: jax.Array, scale: float,
                 equation: tuple[str, str], rate: float, key: jax.Array):
        base_w = getattr(base, name)
        base_w.set_value(jax.lax.stop_gradient(base_w.get_value()))
        self._base, self._name, self._a, self._b = base, name, a, b
        self._scale, self._equation, self._rate, self._key = scale, equation, rate, key

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        y = self._base(x, *args, **kwargs)
        return y + self.added_output(x, y.dtype)

    def added_output(self, x: jax.Array, dtype: Any) -> jax.Array:
        """``(alpha/r) · (drop(x) A) B`` in ``dtype``: what the adapters add to the base's output."""
        if self._rate > 0:
            keep = jax.random.bernoulli(self._key, 1.0 - self._rate, x.shape)
            x = jnp.where(keep, x / (1.0 - self._rate), jnp.zeros((), x.dtype)).astype(x.dtype)
        into_rank, out_of_rank = self._equation
        low = jnp.einsum(into_rank, x.astype(dtype), self._a.astype(dtype))
        return _policy_rows(self._scale * jnp.einsum(out_of_rank, low, self._b.astype(dtype)))

    @property
    def fused_kernel(self) -> jax.Array:
        """The base matrix alone (frozen), for a model that joins several modules' matrices into one matmul
        and adds each one's :meth:`added_output` to its part of the output
        (:func:`meshtron.models.layers.projection_kernel`, :func:`~meshtron.models.layers.with_added_output`)."""
        return getattr(self._base, self._name).get_value()

    def __getattr__(self, attr: str) -> Any:
        if attr == self.__dict__.get("_name"):
            if current().reference_rows:
                raise ConfigError(f"train.objective: dpo in a pipeline runs the frozen reference on rows of their "
                                  f"own, and the model reads the adapted matrix {type(self._base).__name__}.{attr} "
                                  "itself (the adapters merged into it, for every row); use parallel.pipe=1")
            if self._rate > 0:
                raise ConfigError(f"train.lora.dropout: is {self._rate}, and the model reads the adapted matrix "
                                  f"{type(self._base).__name__}.{attr} itself instead of calling its module, which "
                                  "would skip the dropped inputs; set train.lora.dropout=0 or call the module")
            merged = _merge_one(self.fused_kernel, self._a, self._b, self._scale, False)
            return _ArrayRead(checkpoint_name(merged, MERGED))
        return getattr(self._base, attr)


class _ArrayRead:
    """What ``module.kernel`` is read as (``kernel[...]``, ``kernel.value``, ``kernel.shape``)."""

    def __init__(self, value: jax.Array):
        self.value = value

    def __getitem__(self, index: Any) -> jax.Array:
        return self.value[index]

    def get_value(self) -> jax.Array:
        return self.value

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.value, attr)


def _activation_equation(owner: nnx.Module, name: str, ins: int) -> tuple[str, str] | None:
    """The two einsum equations ``x -> x A`` and ``(x A) -> (x A) B`` of an adapted ``kernel`` that its
    module applies to its input's trailing axes; ``None`` when it is not such a kernel."""
    if name != "kernel":
        return None
    if isinstance(owner, nnx.Linear):
        return "...i,ir->...r", "...r,ro->...o"
    if not isinstance(owner, nnx.Einsum) or not isinstance(getattr(owner, "einsum_str", None), str):
        return None
    spec = owner.einsum_str.replace(" ", "")
    if "->" not in spec or spec.count(",") != 1 or "." in spec:
        return None
    operands, y = spec.split("->")
    x, k = operands.split(",")
    k_in, k_out = k[:ins], k[ins:]
    free = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in spec]
    if not free or not set(k_in) <= set(x) or set(k_out) & set(x) or set(y) != (set(x) - set(k_in)) | set(k_out):
        return None
    r = free[0]
    rest = "".join(c for c in x if c not in k_in)
    return f"{x},{k_in}{r}->{rest}{r}", f"{rest}{r},{r}{k_out}->{y}"


def _input_hash(x: jax.Array) -> jax.Array:
    """A uint32 hash of ``x``'s bits (exact integer arithmetic: the same wherever and however it is split)."""
    bits = jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]).astype(jnp.uint32)
    h = bits ^ (jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * jnp.uint32(0x9E3779B9))
    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):  # MurmurHash3's finalizer, per element
        h = (h ^ (h >> shift)) * jnp.uint32(multiplier)
    return jnp.sum(h ^ (h >> 16), dtype=jnp.uint32)


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


def adapters_only(tree: Any) -> dict:
    """The adapters' leaves of a parameter-shaped tree (nested dicts), and the dicts leading to them."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            inner = adapters_only(value)
            if inner:
                out[key] = inner
        elif isinstance(key, str) and is_adapter(key):
            out[key] = value
    return out


def grafted(base: Any, adapters: Any) -> Any:
    """``base`` (a tree without adapters) with ``adapters`` (from :func:`adapters_only`) added where they belong."""
    out = dict(base)
    for key, value in adapters.items():
        out[key] = grafted(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


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


def lora_spec(cfg: LoraConfig) -> LoraSpec | None:
    """``train.lora`` as the model sees it; ``None`` when off (rank 0)."""
    return LoraSpec(cfg.rank, cfg.alpha, tuple(cfg.targets), cfg.dropout) if cfg.rank else None
