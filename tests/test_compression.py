"""1-bit compressed all-reduce (reference tests 1-9): against a dense numpy reference, error feedback
identities, identical outputs, and the bytes that cross the mesh in the compiled program."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from onebit_reference import dense_reference

from meshtron.config import MeshConfig
from meshtron.hlo.collectives import collectives
from meshtron.mesh import build_mesh
from meshtron.optim.compression import (
    _pack,
    _unpack,
    compressed_allreduce,
    compressed_bytes_per_device,
    error_lengths,
    padded_length,
    ring_allreduce_bytes_per_device,
)


def runner(workers: int, segments=None):
    """A jitted step over a data axis of ``workers`` devices: per-device rows in, per-device rows out."""
    mesh = build_mesh(MeshConfig(workers, 1, 1), jax.devices()[:workers])

    def per_device(x, we, se):
        out, we, se = compressed_allreduce(x[0], we[0], se[0], "data", segments=segments)
        return out[None], we[None], se[None]

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                               axis_names={"data"}))
    return mesh, fn


def zeros_state(n, workers):
    total = padded_length(n, workers)
    return np.zeros((workers, total), np.float32), np.zeros((workers, total // workers), np.float32)


def test_padding_table():
    assert {p: padded_length(1, p) for p in (2, 3, 4, 8, 16, 64)} == {2: 16, 3: 72, 4: 32, 8: 64, 16: 256, 64: 4096}
    assert padded_length(100, 8) == 128 and padded_length(128, 8) == 128
    for p in (2, 3, 4, 8):
        assert padded_length(1000, p) % (p * math.lcm(p, 8)) == 0 and (padded_length(1000, p) // p) % 8 == 0


def test_sign_convention_and_packing_round_trip():
    x = jnp.asarray([0.0, -0.5, 2.0, -0.0, 1e-9, -3.0, 0.1, -1e-9, 5.0])
    bits = _pack(jnp.pad(x, (0, 7)))
    assert bits.dtype == jnp.uint8 and bits.shape == (2,)
    signs = _unpack(bits)[:9]
    np.testing.assert_array_equal(signs, [1, -1, 1, 1, 1, -1, 1, -1, 1])  # sgn(0) = +1


@pytest.mark.parametrize("workers", [4, 8])
def test_first_call_equals_dense_reference_and_is_identical_everywhere(workers):
    n = 1000
    x = np.random.default_rng(0).standard_normal((workers, n)).astype(np.float32)
    we, se = zeros_state(n, workers)
    _, fn = runner(workers)
    out, new_we, new_se = map(np.asarray, fn(x, we, se))
    ref_out, ref_we, ref_se, z = dense_reference(x, we, se)
    assert (out == out[0]).all(), "every device must decode the same bits"
    keep = np.abs(z).reshape(-1)[:n] > 1e-6
    np.testing.assert_allclose(out[0][keep], ref_out[keep], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_we, ref_we, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_se, ref_se, rtol=1e-5, atol=1e-5)
    assert (new_we[:, n:] == 0).all(), "padding carries no error"


def test_segments_are_compressed_independently_in_the_same_four_collectives():
    # Two segments, e.g. tensor-split shards and tensor-replicated parameters of one device: each
    # gets its own padding, scales and server chunks, exactly as if compressed alone.
    workers, lengths = 4, (300, 70)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((workers, sum(lengths))).astype(np.float32)
    total, chunk = error_lengths(lengths, workers)
    assert (total, chunk) == (padded_length(300, 4) + padded_length(70, 4), total // 4) == (416, 104)
    mesh, fn = runner(workers, segments=lengths)
    we, se = np.zeros((workers, total), np.float32), np.zeros((workers, chunk), np.float32)
    out, new_we, new_se = map(np.asarray, fn(x, we, se))
    first = dense_reference(x[:, :300], we[:, :320], se[:, :80])
    second = dense_reference(x[:, 300:], we[:, 320:], se[:, 80:])
    np.testing.assert_allclose(out[0], np.concatenate([first[0], second[0]]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_we, np.concatenate([first[1], second[1]], axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_se, np.concatenate([first[2], second[2]], axis=1), rtol=1e-5, atol=1e-5)
    colls = collectives(fn.lower(x, we, se).compile(), mesh)
    assert sorted(c.kind for c in colls) == ["all-gather", "all-gather", "all-gather", "all-to-all"]
    assert compressed_bytes_per_device(lengths, workers) == 2 * 3 * total // 32 + 8 * 2 * 3


def test_error_feedback_telescopes_and_stays_bounded():
    workers, n, steps = 4, 200, 300
    rng = np.random.default_rng(1)
    we, se = zeros_state(n, workers)
    _, fn = runner(workers)
    exact_sum = np.zeros(n)
    out_sum = np.zeros(n)
    norms = []
    for t in range(steps):
        x = rng.standard_normal((workers, n)).astype(np.float32)
        out, we, se = fn(x, we, se)
        exact_sum += x.mean(0)
        out_sum += np.asarray(out[0], np.float64)
        norms.append((np.linalg.norm(we), np.linalg.norm(se)))
    we, se = np.asarray(we), np.asarray(se)
    residual = we.mean(0)[:n] + se.reshape(-1)[:n]
    np.testing.assert_allclose(exact_sum - out_sum, residual, rtol=1e-3, atol=1e-3)
    # Errors stay O(|x|): no growth between the first tenth and the end.
    assert norms[-1][0] < 2 * max(norms[steps // 10][0], 1) and norms[-1][1] < 2 * max(norms[steps // 10][1], 1)
    assert np.linalg.norm(out_sum - exact_sum) / steps < 0.05


def test_one_worker_is_the_identity():
    x = np.random.default_rng(2).standard_normal((1, 50)).astype(np.float32)
    we, se = zeros_state(50, 1)
    _, fn = runner(1)
    out, new_we, new_se = fn(x, we, se)
    np.testing.assert_array_equal(np.asarray(out), x)
    assert not np.asarray(new_we).any() and not np.asarray(new_se).any()


def test_wrong_error_shapes_are_a_clear_error():
    _, fn = runner(4)
    x = np.zeros((4, 100), np.float32)
    with pytest.raises(ValueError, match=r"worker_error must have shape \(128,\) and server_error \(32,\)"):
        fn(x, np.zeros((4, 100), np.float32), np.zeros((4, 25), np.float32))


def test_compiled_traffic_is_sign_bytes_and_scales():
    workers, n = 8, 4096
    mesh, fn = runner(workers)
    we, se = zeros_state(n, workers)
    x = np.zeros((workers, n), np.float32)
    colls = collectives(fn.lower(x, we, se).compile(), mesh)
    kinds = sorted((c.kind, c.dtype) for c in colls)
    assert kinds == [("all-gather", "f32"), ("all-gather", "f32"), ("all-gather", "u8"), ("all-to-all", "u8")]
    assert all(c.axes == ("data",) and c.count == 1 for c in colls)
    sign_bytes = sum(c.bytes for c in colls if c.dtype == "u8")
    assert sign_bytes == 2 * n // 8  # per device: its all-to-all buffer and the gathered server chunks
    sent = compressed_bytes_per_device(n, workers)
    assert sent == 2 * (workers - 1) * n // (8 * workers) + 8 * (workers - 1)
    big = 1 << 20  # the scales' fixed 8(P-1) bytes vanish for real model sizes: 16x vs fp16, 32x vs fp32
    assert ring_allreduce_bytes_per_device(big, workers, 2) / compressed_bytes_per_device(big, workers) > 15.9
    assert ring_allreduce_bytes_per_device(big, workers, 4) / compressed_bytes_per_device(big, workers) > 31.9
