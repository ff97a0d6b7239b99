"""GPUs to compile for without having them: XLA's GPU compiler behind a description of the chip.

A pod's program is XLA:GPU's, not XLA:CPU's: reduce-scatters are real, bf16 collectives stay bf16,
collectives are asynchronous start/done pairs placed by a scheduler, GEMMs are cuBLAS/Triton calls
and cuDNN's fused attention keeps no ``[s, s]`` scores. JAX's CUDA plugin (the ``gpu-compile``
extra) compiles that program on any machine: ``jax.experimental.topologies.get_topology_desc`` takes
a ``GpuTargetConfigProto`` -- the chip's cores, clocks, caches, memory, compute capability -- and
returns compile-only devices of that kind, no GPU and no CUDA libraries needed. The descriptions
ship with meshtron (``descriptions/*.txtpb``); the rates the step-time estimate prices the program
with are the planner's cluster files (:mod:`meshtron.plan.cluster`), one per target.

JAX must find the plugin when it starts: on a machine without CUDA the plugin's version check has to
be skipped (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``, or ``JAX_PLATFORMS=cpu``, which skips it too) --
the CLI sets both before JAX starts; Python users set them before importing JAX
(:func:`prepare_environment`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from meshtron.config import MeshConfig
from meshtron.errors import ConfigError
from meshtron.mesh import AXES, mesh_shape

__all__ = ["EXTRA", "MAX_DEVICES", "TARGETS", "Target", "devices_for_mesh", "prepare_environment", "target", "target_devices"]

EXTRA = "gpu-compile"
MAX_DEVICES = 1024  # compile-only devices in one process; 1024 verified (the plugin returns them all in 3 s)
_INSTALL = f"pip install 'meshtron[{EXTRA}]' (with this stack's constraints file: make test-py312 does)"


@dataclass(frozen=True)
class Target:
    """One GPU kind to compile for: ``description`` is its ``GpuTargetConfigProto`` file in
    ``descriptions/``; ``cluster`` the bundled planner cluster whose rates price its program.

    ``fp8_peak_tflops`` is the chip's dense FP8 tensor-core peak (datasheet, without 2:4 sparsity), at
    which the step-time estimate prices GEMMs whose operands are both 8-bit floats; ``None`` for a chip
    without FP8 tensor cores, for which XLA upcasts float8 dots to bf16 before they reach a GEMM."""

    name: str
    chip: str
    description: str
    cluster: str
    fp8_peak_tflops: float | None = None

    def description_text(self) -> str:
        """The ``GpuTargetConfigProto`` text the compiler is handed."""
        try:
            root = resources.files("meshtron.gpu") / "descriptions"
        except ModuleNotFoundError:  # pragma: no cover - a checkout on PYTHONPATH
            root = Path(__file__).resolve().parent / "descriptions"
        return (root / self.description).read_text()


TARGETS: dict[str, Target] = {
    # H100 SXM: 1,979 TFLOP/s dense FP8 (3,958 with sparsity), twice its 989 bf16; H200 is the same chip.
    "h100": Target("h100", "NVIDIA H100 80GB HBM3 (SXM)", "h100.txtpb", "h100-80gb", fp8_peak_tflops=1979.0),
    "h200": Target("h200", "NVIDIA H200 141GB HBM3e (SXM)", "h200.txtpb", "h200-141gb", fp8_peak_tflops=1979.0),
    "a100": Target("a100", "NVIDIA A100-SXM4-80GB", "a100.txtpb", "a100-80gb"),
}


def target(name: str) -> Target:
    """The target called ``name``; an unknown name is one line listing the known ones."""
    if name not in TARGETS:
        raise ConfigError(f"--target: unknown GPU target {name!r}; use one of {', '.join(TARGETS)}")
    return TARGETS[name]


def prepare_environment() -> None:
    """Let JAX's CUDA plugin load on a machine without CUDA, for compiling only: call before JAX
    starts. ``JAX_PLATFORMS=cpu`` keeps the process's own arrays on the CPU (and skips the plugin's
    check of the CUDA libraries); an explicit setting of either variable is kept."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def target_devices(name: str, count: int) -> list:
    """``count`` compile-only devices of the target ``name``, all in this process, numbered as one
    node after another (8 GPUs per node: the estimator reads NVLink vs network from the ids)."""
    chosen = target(name)
    if not 1 <= count <= MAX_DEVICES:
        raise ConfigError(f"--target {name}: the mesh needs {count} devices; compiling for a GPU target takes 1 to "
                          f"{MAX_DEVICES}, so use a smaller parallel.data/pipe/tensor/context/expert")
    try:
        import jax_plugins.xla_cuda12  # noqa: F401  (the plugin JAX discovers)
    except ImportError:
        raise ConfigError(f"--target {name}: JAX's CUDA plugin is not installed; {_INSTALL}") from None
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(name, "cuda", target_config=chosen.description_text(),
                                                topology=f"1x1x{count}")
    except Exception as err:  # noqa: BLE001 - JAX raises several kinds for a plugin it did not load
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--target {name}: JAX's CUDA plugin did not load ({first}); set "
                          "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 and JAX_PLATFORMS=cpu before JAX starts "
                          "(meshtron.gpu.targets.prepare_environment()) on a machine without CUDA") from None
    return list(topology.devices)


def devices_for_mesh(mesh: MeshConfig, name: str, devices=None) -> list:
    """The compile-only devices of target ``name`` that ``mesh`` (a config's) names: its sizes must be
    written out (no ``-1``: a target has as many GPUs as asked for)."""
    if devices is not None:
        raise ConfigError(f"target={name!r}: pass devices or a target, not both")
    sizes = mesh_shape(mesh)
    if -1 in sizes:
        written = ", ".join(f"parallel.{axis}={size}" for axis, size in zip(AXES, sizes))
        raise ConfigError(f"--target {name}: the mesh must give every size ({written}); a GPU target has as many "
                          "devices as the mesh asks for, so replace -1 with a number")
    return target_devices(name, math.prod(sizes))
