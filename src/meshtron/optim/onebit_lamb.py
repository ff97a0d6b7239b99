"""1-bit LAMB (Li et al., 2021) as an optax gradient transformation that owns the data-parallel reduction.

The transform takes **local** gradients -- each data-parallel shard's own, computed inside a
``shard_map`` that is manual over ``axis_name`` -- and does the communication itself:

* **warmup** (steps ``0 … freeze_step-1``): the gradients are averaged over ``axis_name`` in full
  precision and LAMB runs without bias correction (``u = m / (sqrt(v) + eps) + wd·p``, trust ratio
  ``||p|| / ||u||`` clipped to ``[min_coeff, max_coeff]`` per layer). It records what the second
  stage needs: the EMA of the clipped trust ratio (``lamb_coeff``), the variance ``v`` (frozen when
  warmup ends), and per-layer momentum scaling coefficients that equalise the layers' momentum RMS;
* **compression** (from ``freeze_step`` on): each shard updates its *local* momentum, scales it per
  layer, and the momenta are averaged by one fused 1-bit compressed all-reduce with worker and
  server error feedback (:func:`meshtron.optim.compression.compressed_allreduce`): one
  ``all_to_all`` of sign bytes and three ``all_gather`` s (server signs and two sets of fp32 scales)
  per optimizer step, ~32x less than the fp32 gradient all-reduce. The gradient is reconstructed
  from the synchronized momentum, its fresh variance ``v̂`` drives an adaptive factor
  ``f = max(sqrt(v)+eps) / (sqrt(v̂)+eps)`` (blended toward 1 by the weight-decay share of the
  update, then clipped to ``[factor_min, factor_max]`` and to ±``factor_threshold`` of its last
  value), and the update is ``p − lr·c·f·u`` with the frozen ``v`` and coefficient ``c``.

This is DeepSpeed's ``OnebitLamb`` in its "clean" form (reference §2.10): no discarded first step,
padding re-zeroed before every compression, zero-momentum layers get scaling 1, micro-batch
gradients averaged in both stages (the train step averages them before calling the transform).

**How the stage switch works.** The two stages communicate differently (an fp32 all-reduce versus
an all-to-all and all-gathers of bytes), so the stage cannot be a ``lax.cond`` on the step count:
both branches' collectives would sit in one conditional, which XLA may not run the same way on
every device, and which the compiled-program analysis could not attribute. Instead the stage is
*static*: ``update`` takes the keyword ``compression_stage`` (a Python bool), and a training step
jitted with it as a static argument compiles exactly two programs, one per stage, each with only
its own collectives. The host picks the program each step with
``tx.compression_stage(step)`` (``step >= freeze_step``, with ``step`` the number of updates
already applied). ``optax.chain`` forwards the keyword to this transform and hides it from the
others. The state has the same structure in both stages, so it can be checkpointed and restored in
either.

**Parameters the model splits over the data axis** (a mixture of experts' weights under expert
parallelism: ``param_specs`` name ``axis_name``) have complete gradients where they are held, so
they arrive already averaged (the train step divides them by the number of data ranks:
:meth:`meshtron.optim.zero.ZeroPlan.mean_native`) and are never communicated, in either stage;
their layer norms and maxima are taken over all their shards. Only what is replicated over
``axis_name`` is compressed.

**Layout.** Everything in the state is identical on every data shard except ``worker_error`` and
``server_error``, which are per device: global shape ``[data, shards · n]`` split over ``data`` and
the other mesh axes (:func:`meshtron.optim.opt_state_specs` gives every leaf's spec). Under tensor or
pipeline parallelism each device compresses its own shard of the momentum (a nested ``shard_map``
over the remaining mesh axes, driven by ``param_specs``), with one buffer segment per replication
pattern so that parameters replicated over ``tensor`` or ``pipe`` stay bit-identical there; only the
``data`` axis is communicated over. Parameters stacked on a leading layers axis (``stacked``) get
their trust ratios, factors and scaling coefficients per layer, as in
:func:`meshtron.optim.layerwise_lamb`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.optim.compression import compressed_allreduce, error_lengths
from meshtron.optim.lamb import layer_norm, per_layer
from meshtron.optim.masks import tree_or_call
from meshtron.optim.reduce import mean_over
from meshtron.sharding import axis_names, manual_part, spec_axes, splits_over

PyTree = Any
Axis = str | tuple[str, ...]  # one mesh axis, or a group averaged over as one (data x context)
SpecsLike = PyTree | Callable[[optax.Params], PyTree] | None


class OnebitLambState(NamedTuple):
    """1-bit LAMB's state; per-layer trees hold ``[layers]`` for stacked leaves, scalars otherwise."""

    count: jax.Array  # int32 []: updates applied so far
    mu: optax.Params  # momentum, identical on every data shard
    nu: optax.Params  # second moment; frozen from freeze_step on
    nu_fresh: optax.Params  # v̂: second moment of the reconstructed gradient (compression stage)
    lamb_coeff: optax.Params  # per layer: EMA of the clipped warmup trust ratio (c)
    last_factor: optax.Params  # per layer: the adaptive factor of the previous step (r)
    scaling: optax.Params  # per layer: momentum scaling coefficients (s), fixed when warmup ends
    worker_error: jax.Array  # f32 [data, shards · n]: per device
    server_error: jax.Array  # f32 [data, shards · n / data]: per device


class OnebitLamb(optax.GradientTransformationExtraArgs):
    """What :func:`onebit_lamb` returns: an optax ``GradientTransformationExtraArgs`` (so it chains
    like any other) that also remembers its ``freeze_step`` and ``axis_name``."""

    freeze_step: int
    axis_name: Axis

    def compression_stage(self, step: int) -> bool:
        """The ``compression_stage`` to pass to ``update`` when ``step`` updates have been applied."""
        return step >= self.freeze_step


def onebit_lamb(
    learning_rate: optax.ScalarOrSchedule,
    *,
    freeze_step: int,
    axis_name: Axis = "data",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    mask: PyTree | Callable[[optax.Params], PyTree] | None = None,
    momentum_mask: PyTree | Callable[[optax.Params], PyTree] | None = None,
    param_specs: SpecsLike = None,
    stacked: PyTree | Callable[[optax.Params], PyTree] | None = None,
) -> OnebitLamb:
    """1-bit LAMB; defaults are DeepSpeed's.

    Args:
      learning_rate: a float or an optax schedule of the update count.
      freeze_step: updates of uncompressed LAMB before compression starts (DeepSpeed's tutorial:
        15-25% of training); keep ``1 / (1 - coeff_beta) <= freeze_step``.
      axis_name: the data-parallel mesh axis, or a tuple of axes averaged over together (data and
        context under context parallelism); ``update`` must run inside a ``shard_map`` manual
        over it, and ``init`` under ``jax.set_mesh`` with a mesh that has it.
      b1, b2, eps: moment decay rates and the denominator term (added outside the square root).
      weight_decay: decoupled weight decay added to the update before the trust ratio.
      max_coeff, min_coeff: clip of the warmup trust ratio. coeff_beta: its EMA rate.
      factor_max, factor_min, factor_threshold: absolute and relative bounds of the adaptive factor.
      mask: where weight decay applies, as in ``optax.lamb`` (a tree of bools, or a function of the
        parameters returning one); ``None`` decays everything.
      momentum_mask: DeepSpeed's ``exp_avg_mask``: multiplies the synchronized momentum in the
        compression stage (zeros for entries whose gradient is known to be zero, e.g. unused
        position embeddings, which 1-bit codes cannot represent); a tree of arrays broadcastable
        to the parameters, or a function of the parameters returning one.
      param_specs: the parameters' ``PartitionSpec`` s (or ``NamedSharding`` s, or a function of
        the parameters returning either) when the mesh has axes besides ``axis_name``; ``None``
        treats every parameter as replicated over them.
      stacked: marks leaves whose leading axis stacks layers (trust ratio per layer): a tree of
        bools or a function of the parameters returning one, e.g.
        ``meshtron.optim.stacked_from_axes(axes)`` from the model's logical axes; ``None``: none.
    """
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, (int, np.integer)) or freeze_step < 1:
        raise ValueError(f"freeze_step: must be an integer >= 1 (warmup updates before compression), got {freeze_step!r}")
    _require(0 <= b1 < 1 and 0 <= b2 < 1, "b1, b2", f"must be in [0, 1), got {b1}, {b2}")
    _require(eps >= 0 and weight_decay >= 0, "eps, weight_decay", "must be >= 0")
    _require(0 < min_coeff <= max_coeff, "min_coeff, max_coeff", f"need 0 < min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
    _require(0 <= coeff_beta < 1, "coeff_beta", f"must be in [0, 1), got {coeff_beta}")
    _require(0 < factor_min <= factor_max, "factor_min, factor_max",
             f"need 0 < factor_min <= factor_max, got {factor_min}, {factor_max}")
    _require(factor_threshold >= 0, "factor_threshold", f"must be >= 0, got {factor_threshold}")

    def init(params: optax.Params) -> OnebitLambState:
        mesh = _current_mesh(axis_name, "init")
        if set(axis_names(axis_name)) & set(mesh.manual_axes):
            raise ValueError(
                f"onebit_lamb.init: call it outside shard_map (under `with jax.set_mesh(mesh):`); the state "
                f"is global, with the per-device error buffers split over {axis_name!r}"
            )
        leaves, treedef = jax.tree.flatten(params)
        specs = _spec_leaves(param_specs, params, treedef)
        model_axes = _model_axes(mesh, axis_name)
        native = _native(specs, axis_name)
        local = [_local_shape(x.shape, spec, mesh.shape) for x, spec in zip(leaves, specs, strict=True)]
        _, lengths = _segments(_shared(local, native), _shared(specs, native), model_axes, axis_name)
        workers = _size(mesh, axis_name)
        worker_len, server_len = error_lengths(lengths, workers)
        shards = math.prod(mesh.shape[a] for a in model_axes)
        layers = [jnp.zeros(x.shape[:1] if st else (), jnp.float32) for x, st in zip(leaves, _flags(stacked, params, treedef))]
        return OnebitLambState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(jnp.zeros_like, params),
            nu=jax.tree.map(jnp.zeros_like, params),
            nu_fresh=jax.tree.map(jnp.zeros_like, params),
            lamb_coeff=treedef.unflatten(layers),
            last_factor=treedef.unflatten([jnp.ones_like(x) for x in layers]),
            scaling=treedef.unflatten([jnp.ones_like(x) for x in layers]),
            worker_error=jnp.zeros((workers, shards * worker_len), jnp.float32),
            server_error=jnp.zeros((workers, shards * server_len), jnp.float32),
        )

    def update(updates, state: OnebitLambState, params=None, *, compression_stage=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("onebit_lamb needs the parameters (trust ratio, weight decay): call update(grads, state, params)")
        if not isinstance(compression_stage, (bool, np.bool_)):
            raise TypeError(
                "onebit_lamb.update needs compression_stage=<Python bool>: False for the first "
                f"freeze_step={freeze_step} updates, True afterwards (tx.compression_stage(step)); pass it as a "
                f"static argument of the jitted step, not a traced value (got {compression_stage!r})"
            )
        mesh = _current_mesh(axis_name, "update")
        if not set(axis_names(axis_name)) <= set(mesh.manual_axes):
            raise ValueError(
                f"onebit_lamb.update: run it inside a shard_map that is manual over {axis_name!r}, on each "
                "shard's local gradients"
            )
        treedef = jax.tree.structure(params)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        specs = _spec_leaves(param_specs, params, treedef)
        ctx = _Leaves(treedef, params, updates, state, _flags(stacked, params, treedef),
                      _mask_leaves(mask, params, treedef, default=True),
                      _mask_leaves(momentum_mask, params, treedef, default=None), _native(specs, axis_name))
        if compression_stage:
            return _compression_step(ctx, lr, mesh, specs)
        return _warmup_step(ctx, lr)

    def norm(x, st, own):
        """The (per-layer) norm of a whole leaf: a native leaf's squares summed over its shards."""
        return jnp.sqrt(jax.lax.psum(jnp.square(layer_norm(x, st)), axis_name)) if own else layer_norm(x, st)

    def _warmup_step(ctx: _Leaves, lr):
        # full-precision data-parallel average of what every rank holds (native leaves arrive averaged)
        shared = mean_over([None if own else g for g, own in zip(ctx.updates, ctx.native)], axis_name)
        grads = [g if own else mean for g, mean, own in zip(ctx.updates, shared, ctx.native)]
        out = {k: [] for k in ("update", "mu", "nu", "coeff")}
        for g, m, v, p, st, decay, c, own in zip(grads, ctx.mu, ctx.nu, ctx.params, ctx.stacked, ctx.decay,
                                                 ctx.lamb_coeff, ctx.native):
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            u = _decayed(m / (jnp.sqrt(v) + eps), p, decay, weight_decay)
            w_norm, u_norm = norm(p, st, own), norm(u, st, own)
            defined = (w_norm > 0) & (u_norm > 0)
            ratio = w_norm / jnp.where(u_norm > 0, u_norm, 1.0)
            ratio = jnp.where(defined, jnp.maximum(jnp.minimum(ratio, max_coeff), min_coeff), 1.0)
            # DeepSpeed skips the EMA when the ratio is exactly 1 (undefined norms).
            c = jnp.where(ratio != 1.0, coeff_beta * c + (1 - coeff_beta) * ratio, c)
            out["update"].append((-lr * per_layer(ratio, u) * u).astype(p.dtype))
            out["mu"].append(m)
            out["nu"].append(v)
            out["coeff"].append(c)
        unflat = ctx.treedef.unflatten
        nu = unflat(out["nu"])
        state = ctx.state._replace(
            count=optax.safe_increment(ctx.state.count),
            mu=unflat(out["mu"]),
            nu=nu,
            # The last warmup step's values are the ones the compression stage starts from.
            nu_fresh=nu,
            lamb_coeff=unflat(out["coeff"]),
            scaling=unflat(_scaling_coefficients(out["mu"], ctx.stacked, ctx.native, axis_name)),
        )
        return unflat(out["update"]), state

    def _compression_step(ctx: _Leaves, lr, mesh, specs: list[P]):
        scaled = [(b1 * m + (1 - b1) * g) * per_layer(s, m) for g, m, s in zip(ctx.updates, ctx.mu, ctx.scaling)]
        exchanged, worker_error, server_error = _exchange(
            _shared(scaled, ctx.native), ctx.state.worker_error, ctx.state.server_error,
            _shared(specs, ctx.native), mesh, axis_name
        )
        exchanged = iter(exchanged)
        synced = [x if own else next(exchanged) for x, own in zip(scaled, ctx.native)]
        out = {k: [] for k in ("update", "mu", "nu_fresh", "factor")}
        for m, m_last, v, v_fresh, p, st, decay, mmask, s, c, r, own in zip(
            synced, ctx.mu, ctx.nu, ctx.nu_fresh, ctx.params, ctx.stacked, ctx.decay, ctx.momentum_mask,
            ctx.scaling, ctx.lamb_coeff, ctx.last_factor, ctx.native,
        ):
            m = m / per_layer(s, m)
            if mmask is not None:
                m = m * mmask
            g_hat = (m - b1 * m_last) / (1 - b1)  # the gradient this momentum step implies
            v_fresh = b2 * v_fresh + (1 - b2) * g_hat * g_hat
            denom = jnp.sqrt(v) + eps  # frozen variance
            u_plain = m / denom
            u = _decayed(u_plain, p, decay, weight_decay)
            factor = _layer_max(denom / (jnp.sqrt(v_fresh) + eps), st)
            factor = jax.lax.pmax(factor, axis_name) if own else factor
            if weight_decay > 0:
                plain_norm, u_norm = norm(u_plain, st, own), norm(u, st, own)
                rho = jnp.where(u_norm > 0, jnp.minimum(1.0, plain_norm / jnp.where(u_norm > 0, u_norm, 1.0)), 1.0)
                factor = factor * rho + (1 - rho)
            factor = jnp.maximum(jnp.minimum(factor, factor_max), factor_min)  # absolute bounds,
            factor = jnp.minimum(factor, r * (1 + factor_threshold))  # then relative ones, which win
            factor = jnp.maximum(factor, r * (1 - factor_threshold))
            out["update"].append((-lr * per_layer(c * factor, u) * u).astype(p.dtype))
            out["mu"].append(m)
            out["nu_fresh"].append(v_fresh)
            out["factor"].append(factor)
        unflat = ctx.treedef.unflatten
        state = ctx.state._replace(
            count=optax.safe_increment(ctx.state.count),
            mu=unflat(out["mu"]),
            nu_fresh=unflat(out["nu_fresh"]),
            last_factor=unflat(out["factor"]),
            worker_error=worker_error,
            server_error=server_error,
        )
        return unflat(out["update"]), state

    tx = OnebitLamb(init, update)
    tx.freeze_step = int(freeze_step)
    tx.axis_name = axis_name
    return tx


# --------------------------------------------------------------------------------------------
# Per-leaf helpers


class _Leaves:
    """The trees one update works on, flattened to aligned lists of leaves."""

    def __init__(self, treedef, params, updates, state: OnebitLambState, stacked, decay, momentum_mask, native):
        flat = treedef.flatten_up_to
        self.treedef, self.state, self.native = treedef, state, native
        self.params, self.updates = flat(params), flat(updates)
        self.mu, self.nu, self.nu_fresh = flat(state.mu), flat(state.nu), flat(state.nu_fresh)
        self.lamb_coeff, self.last_factor, self.scaling = flat(state.lamb_coeff), flat(state.last_factor), flat(state.scaling)
        self.stacked, self.decay, self.momentum_mask = stacked, decay, momentum_mask


def _native(specs: list[P], axis_name: Axis) -> list[bool]:
    """Which leaves the parameters' own layout splits over ``axis_name`` (expert parallelism)."""
    return [splits_over(spec, axis_name) for spec in specs]


def _shared(leaves: list, native: list) -> list:
    """The leaves that are replicated over the data axis (the ones 1-bit LAMB compresses)."""
    return [x for x, own in zip(leaves, native, strict=True) if not own]


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _flags(stacked, params, treedef) -> list[bool]:
    if stacked is None:
        return [False] * treedef.num_leaves
    return [bool(x) for x in treedef.flatten_up_to(tree_or_call(stacked, params))]


def _mask_leaves(mask, params, treedef, default):
    if mask is None:
        return [default] * treedef.num_leaves
    return treedef.flatten_up_to(mask(params) if callable(mask) else mask)


def _decayed(u: jax.Array, p: jax.Array, decay, weight_decay: float) -> jax.Array:
    """``u + wd·p`` where the weight-decay mask allows it."""
    if weight_decay == 0 or decay is False:
        return u
    if decay is True:
        return u + weight_decay * p
    return u + weight_decay * p * jnp.asarray(decay, u.dtype)


def _layer_max(x: jax.Array, stacked: bool) -> jax.Array:
    if x.size == 0:
        return jnp.ones(x.shape[:1] if stacked else (), x.dtype)
    return jnp.max(x, axis=tuple(range(1, x.ndim)) if stacked else None)


def _scaling_coefficients(momenta: list[jax.Array], stacked: list[bool], native: list[bool],
                          axis_name: Axis) -> list[jax.Array]:
    """``s = mean_q rms(m_q) / rms(m_p)`` per layer, so every layer's scaled momentum has the same
    RMS before sharing one compression scale; a layer with zero momentum gets 1, empty ones are left
    out of the mean (DeepSpeed divides by zero and gets NaN there). A native leaf's RMS is its whole
    layer's, over all its shards."""
    rms = []
    for m, st, own in zip(momenta, stacked, native):
        per = max(m[0].size if st else m.size, 1)
        if own:
            shards = jax.lax.axis_size(axis_name)
            square = jax.lax.psum(jnp.square(layer_norm(m, st)), axis_name)
            rms.append(jnp.sqrt(square) / math.sqrt(per * shards))
        else:
            rms.append(layer_norm(m, st) / math.sqrt(per))
    count = sum((m.shape[0] if st else 1) for m, st in zip(momenta, stacked) if m.size)
    united = sum(jnp.sum(r) for r in rms) / max(count, 1)
    return [jnp.where(r > 0, united / jnp.where(r > 0, r, 1.0), 1.0) for r in rms]


# --------------------------------------------------------------------------------------------
# Layout: which mesh axes a parameter is split over, and the compressed buffer of one device


def _current_mesh(axis_name: Axis, where: str):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(axis_names(axis_name)) <= set(mesh.axis_names):
        raise ValueError(
            f"onebit_lamb.{where}: no mesh axis {axis_name!r} is in scope; call init under "
            f"`with jax.set_mesh(mesh):` and update inside a shard_map over {axis_name!r} on that mesh"
        )
    return mesh


def _model_axes(mesh, axis_name: Axis) -> tuple[str, ...]:
    """The mesh axes besides ``axis_name`` that have more than one device, in mesh order."""
    return tuple(a for a in mesh.axis_names if a not in axis_names(axis_name) and mesh.shape[a] > 1)


def _size(mesh, axis_name: Axis) -> int:
    """Devices over the axes ``axis_name`` names (the workers that average)."""
    return math.prod(mesh.shape[a] for a in axis_names(axis_name))


def _spec_leaves(param_specs: SpecsLike, params, treedef) -> list[P]:
    """One ``PartitionSpec`` per parameter leaf (``P()`` everywhere when no specs are given)."""
    if param_specs is None:
        return [P()] * treedef.num_leaves
    specs = param_specs(params) if callable(param_specs) else param_specs
    try:
        leaves = treedef.flatten_up_to(specs)  # PartitionSpecs and NamedShardings are leaves
    except (ValueError, TypeError) as err:
        raise ValueError(f"param_specs: must be a tree of PartitionSpecs shaped like the parameters ({err})") from None
    return [s.spec if isinstance(s, NamedSharding) else s for s in leaves]


def _local_shape(shape: Sequence[int], spec: P, sizes) -> tuple[int, ...]:
    """A parameter's per-device shape under ``spec``."""
    local = list(shape)
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        for name in (entry,) if isinstance(entry, str) else entry:
            local[dim] //= sizes[name]
    return tuple(local)


def _segments(shapes, specs: list[P], model_axes: tuple[str, ...], axis_name: Axis):
    """Group leaves by the model axes they are replicated over (one compression segment each).

    Returns ``(groups, lengths)``: the leaf indices of each segment in buffer order, and the
    segment lengths in elements.
    """
    keys: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(specs):
        named = spec_axes(spec)
        if named & set(axis_names(axis_name)):
            raise ValueError(
                f"param_specs: parameter {i} is split over the data axis {axis_name!r} ({spec}); 1-bit LAMB "
                "needs the whole momentum on every data rank (no ZeRO/FSDP sharding over that axis)"
            )
        keys.setdefault(tuple(a for a in model_axes if a not in named), []).append(i)
    groups = list(keys.values())
    lengths = [sum(math.prod(shapes[i]) for i in group) for group in groups]
    return groups, lengths


def _exchange(scaled: list[jax.Array], worker_error, server_error, specs: list[P], mesh, axis_name: Axis):
    """Average the (scaled, local) momenta over ``axis_name`` with one compressed all-reduce.

    Every device flattens its own shard of every momentum leaf into one buffer; when other mesh
    axes are still automatic here, a nested ``shard_map`` makes them manual first, so each device
    sees exactly its shard. ``check_vma`` is off in that nested map: the decoded momentum of a
    parameter replicated over ``tensor`` is identical on those ranks by construction (its own
    segment and scales), which the type system cannot see through the byte buffers.
    """
    if _size(mesh, axis_name) == 1:  # nothing to average; no compression, no error
        return scaled, worker_error, server_error
    model_axes = _model_axes(mesh, axis_name)

    def exchange(leaves, worker_error, server_error):
        groups, lengths = _segments([x.shape for x in leaves], specs, model_axes, axis_name)
        expected = error_lengths(lengths, _size(mesh, axis_name))
        if (worker_error.shape[-1], server_error.shape[-1]) != expected:
            raise ValueError(
                f"onebit_lamb: the error buffers hold {worker_error.shape[-1]} and {server_error.shape[-1]} elements "
                f"per device, but these parameters on this mesh need {expected[0]} and {expected[1]}; the state was "
                "created for another mesh or model -- create it with init on this one"
            )
        order = [i for group in groups for i in group]
        flat = jnp.concatenate([leaves[i].reshape(-1).astype(jnp.float32) for i in order])
        mean, worker_error, server_error = compressed_allreduce(
            flat, worker_error[0], server_error[0], axis_name, segments=lengths
        )
        out: list[Any] = [None] * len(leaves)
        start = 0
        for i in order:
            out[i] = mean[start:start + leaves[i].size].reshape(leaves[i].shape).astype(leaves[i].dtype)
            start += leaves[i].size
        return out, worker_error[None], server_error[None]

    auto = tuple(a for a in model_axes if a not in mesh.manual_axes)
    if not auto:
        return exchange(scaled, worker_error, server_error)
    if len(auto) != len(model_axes):
        raise ValueError(
            f"onebit_lamb.update: mesh axes {model_axes} must be all manual or all automatic here, "
            f"but only {tuple(a for a in model_axes if a in mesh.manual_axes)} are manual"
        )
    error_spec = P(None, auto)
    local_specs = manual_part(list(specs), set(auto))  # size-1 axes named in the specs split nothing
    return jax.shard_map(
        exchange,
        mesh=mesh,
        in_specs=(local_specs, error_spec, error_spec),
        out_specs=(local_specs, error_spec, error_spec),
        axis_names=set(auto),
        check_vma=False,
    )(scaled, worker_error, server_error)


def state_specs(state: OnebitLambState, param_specs: list[P], mesh, axis_name: Axis) -> OnebitLambState:
    """Every leaf's ``PartitionSpec``: moments like their parameters, per-layer values split like
    the layer axis, error buffers per device, the count replicated."""
    treedef = jax.tree.structure(state.mu)

    def layer_specs(tree):
        return treedef.unflatten([
            P(spec[0] if len(spec) else None) if leaf.ndim == 1 else P()
            for leaf, spec in zip(treedef.flatten_up_to(tree), param_specs, strict=True)
        ])

    params = treedef.unflatten(list(param_specs))
    model_axes = _model_axes(mesh, axis_name)
    errors = P(axis_name, model_axes if model_axes else None)
    return OnebitLambState(
        count=P(), mu=params, nu=params, nu_fresh=params,
        lamb_coeff=layer_specs(state.lamb_coeff), last_factor=layer_specs(state.last_factor),
        scaling=layer_specs(state.scaling), worker_error=errors, server_error=errors,
    )
