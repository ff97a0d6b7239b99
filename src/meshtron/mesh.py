"""MeshConfig -> ``jax.sharding.Mesh`` with axes (data, context, pipe, tensor), tensor innermost.

JAX meshes are row-major, so the last axis varies fastest over ``jax.devices()``: putting
``tensor`` last keeps each tensor-parallel group on neighbouring devices (inside one node on a
GPU pod), the way Megatron-LM keeps its TP groups on NVLink. Axes are ``AxisType.Auto``: the
compiler propagates shardings from the annotations, and ``shard_map`` takes manual control of the
axes a transform needs (``data`` and ``context`` for the gradient reduction and the split sequence,
then, nested inside, ``pipe`` for pipelining, ``tensor`` around an exchange). Nested manual axes must
come in mesh order (XLA checks that manual axes are sorted by their index in the mesh), which is why
``context`` precedes ``pipe``: without a pipeline it is next to ``tensor``, as in Megatron-LM's
tp-cp-dp-pp order.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

from meshtron.config import MeshConfig
from meshtron.errors import ConfigError

AXES = ("data", "context", "pipe", "tensor")
_FORCE_FLAG = "--xla_force_host_platform_device_count"


def resolve_sizes(cfg: MeshConfig, n_devices: int) -> MeshConfig:
    """``cfg`` with a -1 filled with the devices left over; checks the product fits in ``n_devices``."""
    sizes = {"data": cfg.data, "pipe": cfg.pipe, "context": cfg.context, "tensor": cfg.tensor}
    known = math.prod(s for s in sizes.values() if s != -1)
    for name, size in sizes.items():
        if size == -1:
            if n_devices % known:
                raise ConfigError(
                    f"parallel.{name}=-1: {n_devices} devices cannot be split evenly by the other axes "
                    f"(product {known}); set parallel.{name} explicitly"
                )
            sizes[name] = n_devices // known
    total = math.prod(sizes.values())
    if total > n_devices:
        names = [a for a in AXES if a != "context" or sizes[a] > 1]
        raise ConfigError(
            f"parallel: {' x '.join(names)} = {' x '.join(str(sizes[a]) for a in names)} = {total} "
            f"devices, but this run has {n_devices}; shrink the mesh (e.g. parallel.data) or add devices (on a CPU, "
            f"simulate them: XLA_FLAGS=--xla_force_host_platform_device_count={total} before JAX starts)"
        )
    return MeshConfig(**sizes)


def mesh_shape(cfg: MeshConfig) -> tuple[int, ...]:
    """The sizes of a resolved ``cfg`` in :data:`AXES` order."""
    return tuple(getattr(cfg, axis) for axis in AXES)


def shown_sizes(shape) -> dict[str, int]:
    """A mesh's sizes as printed for people: ``context`` only when sequences are split over it."""
    return {axis: int(size) for axis, size in dict(shape).items() if axis != "context" or size > 1}


def build_mesh(cfg: MeshConfig, devices=None, *, verbose: bool = False):
    """A (data, context, pipe, tensor) mesh over the first data*context*pipe*tensor devices.

    A mesh smaller than the device count uses a subset and says so (when ``verbose``).
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(resolve_sizes(cfg, len(devices)))
    used = math.prod(shape)
    if used < len(devices) and verbose:
        print(f"meshtron: mesh {shape} uses {used} of {len(devices)} devices", file=sys.stderr)
    grid = np.array(devices[:used], dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def devices_requested(cfg: MeshConfig, default: int = 8) -> int:
    """Devices a config needs; with a -1 axis, the larger of ``default`` and the fixed product."""
    sizes = (cfg.data, cfg.pipe, cfg.context, cfg.tensor)
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 not in sizes:
        return fixed
    return max(default, fixed) if max(default, fixed) % fixed == 0 else fixed


def _has_accelerator_plugin() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() not in ("", "cpu"):
        return True
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    return any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


# Larger meshes (the paper's 3072 GPUs) are planned or compiled from abstract devices, never simulated.
MAX_SIMULATED_DEVICES = 64


def simulate_devices_for(cfg: MeshConfig) -> bool:
    """On a CPU, before JAX starts: as many simulated devices as the mesh needs (up to
    :data:`MAX_SIMULATED_DEVICES`), so that a run of the Python API works as the command line does."""
    needed = devices_requested(cfg)
    return needed <= MAX_SIMULATED_DEVICES and ensure_cpu_devices(needed)


def ensure_cpu_devices(n: int) -> bool:
    """Ask XLA for ``n`` host devices when running on CPU; call before JAX initialises.

    Appends ``--xla_force_host_platform_device_count=n`` to ``XLA_FLAGS`` and never replaces what
    the user set: an existing count is left alone. Returns whether the flag was added.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _FORCE_FLAG in flags or _has_accelerator_plugin() or n <= 1:
        return False
    if "jax" in sys.modules:
        import jax

        if jax._src.xla_bridge.backends_are_initialized():  # too late to change the device count
            return False
    os.environ["XLA_FLAGS"] = f"{flags} {_FORCE_FLAG}={n}".strip()
    return True
