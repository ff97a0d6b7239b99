"""The experts' grouped matmul: tokamax's grouped-GEMM kernel on Hopper GPUs, ``jax.lax.ragged_dot`` elsewhere.

``jax.lax.ragged_dot(lhs [m, k], rhs [E, k, n], sizes)`` multiplies each group of ``lhs``'s rows by its
expert's matrix. XLA lowers it, on CPU and on GPU alike (``--xla_gpu_experimental_use_ragged_dot_grouped_gemm``
included), to a masked dense product: every row selected into an ``[E, m, k]`` operand, one batched GEMM,
a reduction over the groups -- ``E`` times the FLOPs of the grouped product, forward and backward.
tokamax (an optional dependency: ``pip install tokamax`` on Python 3.12, JAX >= 0.11.1) has a Mosaic GPU
grouped GEMM for sm90 that multiplies each row by its own expert only. This module picks it when the
program is compiled for NVIDIA GPUs and tokamax imports; otherwise, and on every CPU, it is
``jax.lax.ragged_dot`` itself, so the numbers there are the same as before.

tokamax chooses its kernel for JAX's *default* device's compute capability when the function is traced;
a program compiled for a compile-only GPU target (:mod:`meshtron.gpu.targets`) has the CPU as default
device, so every kernel call here is traced with the mesh's first device as the default. The mesh is
the one ``jax.set_mesh`` put in effect (the train step's); without one the program's devices are
JAX's default backend's.

Its own VJP (rather than tokamax's) keeps every traced kernel under that default device, the backward's
too: ``dlhs`` is the grouped product with each expert's matrix transposed, ``drhs`` the per-group
product over each group's rows. It also keeps ``jax.lax.ragged_dot``'s meaning where the kernel leaves
memory unwritten: rows past the groups' total are zero, and so is the gradient of an expert with no rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from meshtron.sharding import varying_like

__all__ = ["GROUPED_KERNELS", "grouped_matmul", "kernel_for"]

GROUPED_KERNELS = ("xla", "tokamax")
"""What :func:`kernel_for` may pick: ``jax.lax.ragged_dot`` as XLA compiles it, or tokamax's Mosaic GPU kernel."""

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # the sm90 kernel's operand types

_WEIGHT_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
"""``lhs [m, k]`` and ``g [m, n]`` contracted over the rows of each group: ``[E, k, n]``."""


@functools.cache
def _tokamax() -> Any | None:
    """The tokamax module, or ``None`` where it is not installed (or does not import with this JAX)."""
    try:
        import tokamax
    except Exception:  # noqa: BLE001 - an optional dependency: any import failure means "not available"
        return None
    return tokamax


def _program_device() -> jax.Device:
    """The first device of the mesh in effect (``jax.set_mesh``), else JAX's default device: which chip
    the program being traced is compiled for. ``get_concrete_mesh`` is JAX's own reader of that mesh,
    and works inside ``jit`` and ``shard_map`` (``jax.sharding.get_mesh`` is refused there)."""
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.get_concrete_mesh()
    if mesh is not None and not mesh.empty:
        return mesh.devices.flat[0]
    return jax.devices()[0]


def kernel_for(device: jax.Device) -> str:
    """``"tokamax"`` for an NVIDIA GPU of compute capability 9.x (Hopper: the kernel's sm90 path) when
    tokamax imports, ``"xla"`` otherwise (CPU, other GPUs, tokamax absent)."""
    if device.platform != "gpu" or _tokamax() is None:
        return "xla"
    capability = getattr(device, "compute_capability", None)
    try:
        major = int(float(capability))
    except (TypeError, ValueError):
        return "xla"
    return "tokamax" if major == 9 else "xla"


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs [m, k], rhs [E, k, n], group_sizes [E])`` in ``lhs``'s dtype: tokamax's
    grouped GEMM when the program is compiled for a Hopper GPU and tokamax is installed, else
    ``jax.lax.ragged_dot``."""
    rhs = rhs.astype(lhs.dtype)
    device = _program_device()
    rest = _automatic_axes()
    if kernel_for(device) == "xla" or lhs.dtype not in _KERNEL_DTYPES or rest is None:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    tokamax = _tokamax()

    def on_device(call: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        def kernel(*args: Any) -> jax.Array:
            with jax.default_device(device):
                return call(*args, implementation="mosaic_gpu")

        if not rest:
            return kernel
        # Every axis manual: jnp.searchsorted, which tokamax's tiling of the groups calls, fails on a value
        # that varies over the manual axes of a shard_map that leaves others automatic (a JAX error); the
        # axes left are all of size 1 here, so making them manual too moves no data.
        return jax.shard_map(kernel, in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(),
                             axis_names=rest, check_vma=False)

    weight_gradient = functools.partial(tokamax.ragged_dot_general, ragged_dot_dimension_numbers=_WEIGHT_GRADIENT)
    return _kernel_grouped_matmul(lhs, rhs, group_sizes, on_device(tokamax.ragged_dot), on_device(weight_gradient))


def _automatic_axes() -> frozenset[str] | None:
    """Inside a ``shard_map`` that leaves some mesh axes automatic: those axes (empty outside one, or where
    every axis is manual); ``None`` when one of them has more than one device -- the kernel would then run
    whole on each of them, so the grouped matmul stays XLA's, which the partitioner splits."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return frozenset()
    manual = [t == jax.sharding.AxisType.Manual for t in mesh.axis_types]
    if not any(manual):
        return frozenset()
    rest = {name: size for name, size, m in zip(mesh.axis_names, mesh.axis_sizes, manual) if not m}
    return None if any(size > 1 for size in rest.values()) else frozenset(rest)


def _kernel_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                           ragged_dot: Callable[..., jax.Array],
                           weight_gradient: Callable[..., jax.Array]) -> jax.Array:
    """The grouped product through ``ragged_dot`` (``jax.lax.ragged_dot``'s signature) with its VJP through
    ``ragged_dot`` and ``weight_gradient`` (``lhs [m, k]``, ``g [m, n]``, sizes: ``[E, k, n]``), and ``jax.lax.ragged_dot``'s zeros where a kernel may
    leave memory unwritten (rows past the groups, experts with no rows)."""

    def typed(y: jax.Array, *like: jax.Array) -> jax.Array:
        for ref in like:  # a Pallas kernel's output inside shard_map varies over no axis; its inputs' do
            y = varying_like(y, ref)
        return y

    def covered_rows(y: jax.Array, sizes: jax.Array) -> jax.Array:
        rows = jnp.arange(y.shape[0], dtype=sizes.dtype)
        return jnp.where((rows < jnp.sum(sizes))[:, None], y, jnp.zeros((), y.dtype))

    @jax.custom_vjp
    def product(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        return covered_rows(typed(ragged_dot(x, w, sizes), x, w, sizes), sizes)

    def forward(x: jax.Array, w: jax.Array, sizes: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return product(x, w, sizes), (x, w, sizes)

    def backward(residuals: tuple[jax.Array, ...], g: jax.Array) -> tuple[jax.Array, jax.Array, None]:
        x, w, sizes = residuals
        g = g.astype(x.dtype)
        dx = covered_rows(typed(ragged_dot(g, jnp.swapaxes(w, 1, 2), sizes), x), sizes)
        dw = typed(weight_gradient(x, g, sizes), w)
        dw = jnp.where((sizes > 0)[:, None, None], dw, jnp.zeros((), dw.dtype))
        return dx, dw.astype(w.dtype), None

    product.defvjp(forward, backward)
    # The three operands vary over the same manual axes, so the rule's cotangents match its inputs';
    # an operand that varied over fewer gets its cotangent summed by JAX outside the rule.
    lhs, rhs, group_sizes = (typed(a, lhs, rhs, group_sizes) for a in (lhs, rhs, group_sizes))
    return product(lhs, rhs, group_sizes)
