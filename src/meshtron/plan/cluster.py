"""A cluster as the planner sees it: peak rates, memory, links, and how much of each is achieved.

Why a file and not constants: the same model and layout run at very different speeds on an A100
pod with eight InfiniBand cards per node, an H100 pod, or A100s behind two Ethernet ports, and
the planner's answer (which layout, whether 1-bit compression pays) changes with it. The bundled
files (``clusters/*.yaml``) describe those three; a user's own YAML file with the same fields
describes theirs. Every rate is a datasheet figure; the ``efficiency`` block holds the fraction of
it that kernels and collectives achieve, and the optional ``step_overhead_us`` the GPU's idle time
per pipeline step that the training program's host synchronisation costs: the only places where
measured behaviour enters.

Units are spelled in the field names: ``_tflops`` (10^12 FLOP/s), ``_gbps`` (10^9 *bytes*/s,
per direction), ``_gb`` (10^9 bytes), ``_us`` (microseconds).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from meshtron.errors import ConfigError

__all__ = ["Cluster", "bundled_clusters", "load_cluster"]

_FIELDS = {  # field -> what it means (the error message for a missing one says so)
    "gpus_per_node": "GPUs in one node (the NVLink domain)",
    "peak_tflops": "one GPU's dense 16-bit tensor-core peak, TFLOP/s",
    "memory_gb": "one GPU's memory, GB",
    "reserved_gb": "memory the planner keeps free per GPU (CUDA context, workspaces, NCCL buffers), GB",
    "hbm_gbps": "one GPU's memory bandwidth, GB/s",
    "nvlink_gbps": "one GPU's NVLink bandwidth per direction, GB/s",
    "nvlink_latency_us": "latency of one step of an intra-node collective, us",
    "network_gbps": "one node's network bandwidth per direction (all its NICs), GB/s",
    "network_latency_us": "latency of one step of an inter-node collective or send, us",
}
_OPTIONAL = {  # field -> default
    "step_overhead_us": 0.0,  # GPU idle per forward or backward step of a microbatch or pipeline chunk, us
}
_EFFICIENCIES = ("memory", "nvlink", "network")


@dataclass(frozen=True)
class Cluster:
    """One homogeneous GPU cluster; see the module docstring for units.

    ``gemm_efficiency`` maps a GEMM's smallest dimension to the fraction of ``peak_tflops`` it
    achieves (interpolated log-linearly between the tabulated sizes, flat beyond them); the other
    efficiencies are fractions of the memory, NVLink and network bandwidths that element-wise
    kernels and NCCL collectives achieve. ``step_overhead_us`` is the training program's, not the
    hardware's: Megatron-LM of 2021 calls ``torch.cuda.synchronize`` around every forward and backward
    step (its timers) and every pipeline exchange, and the GPU idles each time until the host has
    issued the next kernel; an XLA program compiled whole, like meshtron's, has none (0, the default).
    """

    name: str
    gpus_per_node: int
    peak_tflops: float
    memory_gb: float
    reserved_gb: float
    hbm_gbps: float
    nvlink_gbps: float
    nvlink_latency_us: float
    network_gbps: float
    network_latency_us: float
    gemm_efficiency: tuple[tuple[int, float], ...]
    memory_efficiency: float
    nvlink_efficiency: float
    network_efficiency: float
    description: str = ""
    step_overhead_us: float = 0.0

    @property
    def usable_memory_bytes(self) -> float:
        """What a layout may use per GPU: the memory minus ``reserved_gb``."""
        return (self.memory_gb - self.reserved_gb) * 1e9

    @property
    def nic_gbps(self) -> float:
        """One GPU's share of the node's network bandwidth (one NIC per GPU on DGX-style nodes)."""
        return self.network_gbps / self.gpus_per_node

    def gemm(self, smallest_dimension: float) -> float:
        """Achieved fraction of peak for a GEMM whose smallest dimension is ``smallest_dimension``.

        Log-linear interpolation in the table: GEMM efficiency grows with the tile count roughly
        by doublings of the dimension, so equal ratios of size get equal steps of efficiency."""
        sizes = [size for size, _ in self.gemm_efficiency]
        values = [value for _, value in self.gemm_efficiency]
        if smallest_dimension <= sizes[0]:
            return values[0]
        if smallest_dimension >= sizes[-1]:
            return values[-1]
        x = math.log(smallest_dimension)
        for (lo, e_lo), (hi, e_hi) in zip(self.gemm_efficiency, self.gemm_efficiency[1:]):
            if smallest_dimension <= hi:
                weight = (x - math.log(lo)) / (math.log(hi) - math.log(lo))
                return e_lo + weight * (e_hi - e_lo)
        return values[-1]  # unreachable: the loop covers every size up to the last


def _root() -> Traversable:
    try:
        return resources.files("meshtron.plan") / "clusters"
    except ModuleNotFoundError:  # pragma: no cover - a checkout on PYTHONPATH
        return Path(__file__).resolve().parent / "clusters"


def bundled_clusters() -> dict[str, Traversable]:
    """The cluster files shipped with meshtron, name -> file."""
    root = _root()
    return {entry.name.removesuffix(".yaml"): entry for entry in sorted(root.iterdir(), key=lambda e: e.name)
            if entry.name.endswith(".yaml")}


def load_cluster(name_or_path: str | os.PathLike) -> Cluster:
    """A bundled cluster by name (``a100-80gb``, ``h100-80gb``, ``a100-ethernet``) or a YAML file.

    An existing file wins over a bundled name. Errors are one :class:`ConfigError` line naming the
    field and the fix."""
    path = Path(name_or_path)
    shipped = bundled_clusters()
    if path.is_file():
        source: Any = path
        origin = os.fspath(path)
    elif os.fspath(name_or_path).removesuffix(".yaml") in shipped:
        origin = os.fspath(name_or_path).removesuffix(".yaml")
        source = shipped[origin]
    else:
        raise ConfigError(f"--cluster: no such file or bundled cluster {os.fspath(name_or_path)!r}; "
                          f"bundled: {', '.join(shipped)}")
    try:
        values = yaml.safe_load(source.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"cluster {origin}: not valid YAML ({str(err).splitlines()[0]})") from None
    return cluster_from_dict(values, origin)


def cluster_from_dict(values: Any, origin: str) -> Cluster:
    """Validate a parsed cluster file; ``origin`` names it in error messages."""
    if not isinstance(values, dict):
        raise ConfigError(f"cluster {origin}: expected a mapping of fields ({', '.join(_FIELDS)}), got {values!r}")
    unknown = sorted(set(values) - set(_FIELDS) - set(_OPTIONAL) - {"name", "description", "efficiency"})
    if unknown:
        raise ConfigError(f"cluster {origin}: unknown field {unknown[0]!r}; the fields are "
                          f"{', '.join([*_FIELDS, *_OPTIONAL, 'efficiency', 'name', 'description'])}")
    numbers = {}
    for name, meaning in _FIELDS.items():
        if name not in values:
            raise ConfigError(f"cluster {origin}: {name}: missing; give {meaning}")
        numbers[name] = _positive(values[name], name, origin, allow_zero=name.endswith(("_us", "reserved_gb")))
    for name, default in _OPTIONAL.items():
        numbers[name] = _positive(values.get(name, default), name, origin, allow_zero=True)
    if numbers["gpus_per_node"] != int(numbers["gpus_per_node"]):
        raise ConfigError(f"cluster {origin}: gpus_per_node: must be a whole number, got {values['gpus_per_node']}")
    if numbers["reserved_gb"] >= numbers["memory_gb"]:
        raise ConfigError(f"cluster {origin}: reserved_gb: {numbers['reserved_gb']:g} leaves nothing of "
                          f"memory_gb={numbers['memory_gb']:g}; reserve less")
    efficiency = values.get("efficiency")
    if not isinstance(efficiency, dict):
        raise ConfigError(f"cluster {origin}: efficiency: missing; give gemm (a table smallest dimension -> "
                          f"fraction of peak) and {', '.join(_EFFICIENCIES)} (fractions of bandwidth)")
    unknown = sorted(set(map(str, efficiency)) - {*_EFFICIENCIES, "gemm"})
    if unknown:
        raise ConfigError(f"cluster {origin}: efficiency.{unknown[0]}: unknown; the fields are gemm, "
                          f"{', '.join(_EFFICIENCIES)}")
    fractions = {}
    for name in _EFFICIENCIES:
        if name not in efficiency:
            raise ConfigError(f"cluster {origin}: efficiency.{name}: missing; give the achieved fraction of the "
                              "bandwidth, e.g. 0.8")
        fractions[name] = _fraction(efficiency[name], f"efficiency.{name}", origin)
    table = efficiency.get("gemm")
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"cluster {origin}: efficiency.gemm: give a table smallest GEMM dimension -> fraction "
                          "of peak, e.g. {256: 0.4, 4096: 0.7}")
    gemm = []
    for size, value in table.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"cluster {origin}: efficiency.gemm: keys are GEMM dimensions (positive integers), "
                              f"got {size!r}")
        gemm.append((size, _fraction(value, f"efficiency.gemm[{size}]", origin)))
    return Cluster(
        name=str(values.get("name", origin)),
        description=str(values.get("description", "")).strip(),
        gpus_per_node=int(numbers["gpus_per_node"]),
        peak_tflops=numbers["peak_tflops"], memory_gb=numbers["memory_gb"], reserved_gb=numbers["reserved_gb"],
        hbm_gbps=numbers["hbm_gbps"], nvlink_gbps=numbers["nvlink_gbps"],
        nvlink_latency_us=numbers["nvlink_latency_us"], network_gbps=numbers["network_gbps"],
        network_latency_us=numbers["network_latency_us"],
        gemm_efficiency=tuple(sorted(gemm)),
        memory_efficiency=fractions["memory"], nvlink_efficiency=fractions["nvlink"],
        network_efficiency=fractions["network"], step_overhead_us=numbers["step_overhead_us"],
    )


def _positive(value: Any, name: str, origin: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"cluster {origin}: {name}: expected a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"cluster {origin}: {name}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


def _fraction(value: Any, name: str, origin: str) -> float:
    number = _positive(value, name, origin)
    if number > 1:
        raise ConfigError(f"cluster {origin}: {name}: a fraction is at most 1, got {value}")
    return number
