"""1-bit compressed all-reduce with two-level error feedback (1-bit Adam/LAMB, DeepSpeed's NCCL backend).

Every worker sends one sign bit per element plus one fp32 scale, instead of 32-bit values:

1. worker: ``b = x + worker_error``; one scale ``α = rms(b)`` for the whole padded buffer;
   the new worker error is what compression lost, ``b − α·sgn(b)``; signs are packed 8 per byte;
2. phase 1: ``all_to_all`` of the sign chunks (worker ``i`` sends chunk ``j`` to worker ``j``) and
   ``all_gather`` of the scales; worker ``r`` is the *server* of chunk ``r``: it averages the
   decompressed chunks, adds its server error, re-compresses with the chunk's own scale
   ``β = rms(z)`` and keeps ``z − β·sgn(z)`` as the new server error;
3. phase 2: ``all_gather`` of the server sign chunks and scales; every worker decodes the same
   result.

Traffic per worker is about ``2·(P−1)/P`` bits per element: 16x less than an fp16 and 32x less
than an fp32 ring all-reduce. The errors telescope: summed over steps, the output equals the
summed exact mean minus (mean worker error + server error), so nothing is lost, only delayed.
Must run inside ``shard_map`` with ``axis_name`` manual; errors are per-device state.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def padded_length(n: int, workers: int) -> int:
    """Buffer length: a multiple of P·lcm(P, 8), so P equal chunks each pack into whole bytes."""
    step = workers * math.lcm(workers, 8)
    return max(step, -(-n // step) * step)


def _signs(x: jax.Array) -> jax.Array:
    """±1 with sgn(0) = +1 (the bit packed for 0 is 1)."""
    return jnp.where(x >= 0, 1.0, -1.0).astype(jnp.float32)


def _pack(x: jax.Array) -> jax.Array:
    return jnp.packbits(x >= 0, axis=-1, bitorder="big")


def _unpack(bits: jax.Array) -> jax.Array:
    return jnp.unpackbits(bits, axis=-1, bitorder="big").astype(jnp.float32) * 2.0 - 1.0


def _rms(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x)) / x.size)


def compressed_allreduce(
    x: jax.Array, worker_error: jax.Array, server_error: jax.Array, axis_name: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean of the flat fp32 vector ``x`` over ``axis_name``, 1-bit compressed with error feedback.

    ``x`` has any length ``n``; ``worker_error`` has length ``padded_length(n, P)`` and
    ``server_error`` that length divided by P (start both at zero). Returns ``(mean, new
    worker_error, new server_error)``; the mean (length ``n``) is identical on every device. With
    one worker nothing is compressed and ``x`` comes back unchanged.
    """
    workers = jax.lax.axis_size(axis_name)
    if workers == 1:
        return x, worker_error, server_error
    n = x.shape[0]
    total = padded_length(n, workers)
    chunk = total // workers
    if worker_error.shape != (total,) or server_error.shape != (chunk,):
        raise ValueError(
            f"worker_error must have shape ({total},) and server_error ({chunk},) for {n} elements over "
            f"{workers} workers; got {worker_error.shape} and {server_error.shape}"
        )
    valid = jnp.arange(total) < n
    # The padding is re-zeroed before every compression: it must never carry error into the scale.
    buffer = jnp.where(valid, jnp.pad(x.astype(jnp.float32), (0, total - n)) + worker_error, 0.0)
    alpha = _rms(buffer)
    worker_error = jnp.where(valid, buffer - alpha * _signs(buffer), 0.0)

    # Phase 1: chunk j of every worker's signs goes to worker j; everyone learns every scale.
    sent = _pack(buffer).reshape(workers, chunk // 8)
    received = jax.lax.all_to_all(sent, axis_name, split_axis=0, concat_axis=0, tiled=True)
    alphas = jax.lax.all_gather(alpha, axis_name)
    z = jnp.sum(alphas[:, None] / workers * _unpack(received), axis=0) + server_error
    beta = _rms(z)
    server_error = z - beta * _signs(z)

    # Phase 2: every server's re-compressed chunk and scale go to everyone.
    chunks = jax.lax.all_gather(_pack(z), axis_name)
    betas = jax.lax.all_gather(beta, axis_name)
    mean = (betas[:, None] * _unpack(chunks)).reshape(total)
    return mean[:n], worker_error, server_error


def compressed_bytes_per_device(n: int, workers: int) -> int:
    """Network bytes one worker sends per call: signs in both phases plus two fp32 scales per peer."""
    if workers == 1:
        return 0
    total = padded_length(n, workers)
    return 2 * (workers - 1) * total // (8 * workers) + 8 * (workers - 1)


def ring_allreduce_bytes_per_device(n: int, workers: int, bytes_per_element: int) -> float:
    """What a ring all-reduce of the same vector sends per worker: 2(P−1)/P · n · bytes."""
    return 2 * (workers - 1) / workers * n * bytes_per_element
