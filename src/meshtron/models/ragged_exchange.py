"""Ragged all-to-all over a manual mesh axis: each device sends each other device exactly the rows
meant for it, not a worst-case block.

:func:`expert_plans` turns the assignments every device routes to every expert (``counts`` [n, E],
gathered over the axis) into the four index arrays of ``jax.lax.ragged_all_to_all`` for the trip to
the experts and for the trip back, and :func:`ragged_all_to_all` runs one of them. The sender's rows
are sorted by expert, so its slice for each expert is contiguous; each slice is one ``ragged_all_to_all``
slice (``E`` of them, ``E/n`` per destination), written on the receiver where its expert's group of
rows starts plus the rows earlier senders put there. So the receiver's buffer comes out grouped by its
local experts, sources in order inside each group, ready for grouped matmuls with no sort; the trip
back swaps the roles and lands every row where it left.

``jax.lax.ragged_all_to_all`` (jax 0.10 and 0.12 alike) is a custom call that XLA:GPU and TPU run
and XLA:CPU cannot (``UNIMPLEMENTED: HLO opcode ragged-all-to-all``). On CPU the same plan runs through
:func:`emulated_ragged_all_to_all`, which has the primitive's semantics and moves a padded block per
destination with an ordinary all-to-all; ``jax.lax.platform_dependent`` picks one when the program is
lowered, so one traced step serves both and the plan code is shared. JAX differentiates both: the
primitive's transpose is the reverse ragged exchange (JAX's own rule), the emulation's is made of
gathers, scatters and all-to-alls.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RaggedPlan(NamedTuple):
    """One ``ragged_all_to_all``: ``[K]`` int32 arrays, ``K/n`` slices per destination (in
    destination order). Slice ``i`` sends ``operand[input_offsets[i]:][:send_sizes[i]]`` to device
    ``i // (K/n)``, which writes it at ``output_offsets[i]``; ``recv_sizes[i]`` is how many rows this
    device receives in its ``i``-th slice (from device ``i // (K/n)``)."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


class ExpertPlans(NamedTuple):
    """The trip to the experts and back, and this device's rows per local expert ``[E/n]`` in the
    order its received buffer holds them (the grouped matmuls' group sizes)."""

    dispatch: RaggedPlan
    combine: RaggedPlan
    group_sizes: jax.Array


def _before(x: jax.Array, axis: int) -> jax.Array:
    """Exclusive cumulative sum along ``axis``: where each entry's rows start."""
    return jnp.cumsum(x, axis=axis) - x


def expert_plans(counts: jax.Array, rank: jax.Array, local: int) -> ExpertPlans:
    """The ragged exchanges of a device ``rank`` (of ``n``) holding experts ``rank·local ..`` whose rows,
    sorted by expert, leave from a buffer that holds each sender's rows in expert order.

    ``counts`` [n, E]: the assignments device ``s`` routes to expert ``e``, the same on every device.
    Expert ``e``'s rows from source ``s`` start, on the sender, after its rows for the experts before
    ``e`` (``sent_before``); on ``e``'s owner, after the groups of the owner's experts before ``e``
    and the rows earlier sources sent ``e`` (``landing``).
    """
    counts = counts.astype(jnp.int32)
    n, experts = counts.shape
    sent_before = _before(counts, 1)  # [n, E]
    held = counts.sum(0).reshape(n, local)  # rows each expert gets, by owner
    landing = _before(held, 1).reshape(1, experts) + _before(counts, 0)  # [n, E]
    mine = jax.lax.dynamic_index_in_dim(counts, rank, 0, keepdims=False)  # [E]: what this device sends

    def own(x):  # [n, E] -> [n·local]: the entries of this device's experts, source-major
        return jax.lax.dynamic_slice_in_dim(x, rank * local, local, axis=1).reshape(-1)

    received = own(counts)
    dispatch = RaggedPlan(jax.lax.dynamic_index_in_dim(sent_before, rank, 0, keepdims=False), mine,
                          jax.lax.dynamic_index_in_dim(landing, rank, 0, keepdims=False), received)
    combine = RaggedPlan(own(landing), received, own(sent_before), mine)
    return ExpertPlans(dispatch, combine, received.reshape(n, local).sum(0))


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array, plan: RaggedPlan, axis: str,
                               block: int) -> jax.Array:
    """``jax.lax.ragged_all_to_all``'s result from an ordinary all-to-all (XLA:CPU has no ragged one):
    each destination's slices are packed into a ``block``-row buffer (``block``: the most rows this
    device sends any one device) with the row each lands on, exchanged, and scattered into
    ``output``; rows no slice writes keep ``output``'s values. ``plan.recv_sizes`` is implied by
    what arrives."""
    n = jax.lax.axis_size(axis)
    per = plan.send_sizes.shape[0] // n
    sizes = plan.send_sizes.reshape(n, per)
    ends = jnp.cumsum(sizes, axis=1)
    q = jnp.arange(block, dtype=ends.dtype)
    # the slice each packed row comes from: how many of its destination's slices end at or before it
    which = jnp.minimum(jnp.sum(ends[:, None, :] <= q[None, :, None], axis=-1, dtype=ends.dtype), per - 1)
    within = q[None, :] - jnp.take_along_axis(ends - sizes, which, axis=1)
    slices = jnp.arange(n, dtype=which.dtype)[:, None] * per + which
    valid = q[None, :] < ends[:, -1:]
    rows = jnp.where(valid, plan.input_offsets[slices] + within, 0)
    landing = jnp.where(valid, plan.output_offsets[slices] + within, output.shape[0]).reshape(-1)
    packed = jnp.take(operand, rows.reshape(-1), axis=0)
    arrived = jax.lax.all_to_all(packed, axis, 0, 0, tiled=True)
    where = jax.lax.all_to_all(landing, axis, 0, 0, tiled=True)
    return output.at[where].set(arrived.astype(output.dtype), mode="drop")


def ragged_all_to_all(operand: jax.Array, output: jax.Array, plan: RaggedPlan, axis: str, block: int) -> jax.Array:
    """``plan``'s exchange over ``axis``: ``jax.lax.ragged_all_to_all`` where the program is lowered for
    a GPU or TPU, :func:`emulated_ragged_all_to_all` (``block`` rows per destination) for a CPU."""

    def real(operand, output, *plan):
        return jax.lax.ragged_all_to_all(operand, output, *plan, axis_name=axis)

    def emulated(operand, output, *plan):
        return emulated_ragged_all_to_all(operand, output, RaggedPlan(*plan), axis, block)

    return jax.lax.platform_dependent(operand, output, *plan, cpu=emulated, default=real)
