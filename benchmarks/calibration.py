"""The planner's model on this machine: measured per-operation costs of the simulated CPU mesh in, the
step time of meshtron's own runs out.

:mod:`meshtron.plan.timing` prices a layout on a GPU cluster from a datasheet and a short efficiency
table. Nothing in it is specific to GPUs: GEMMs at a rate that depends on their smallest dimension,
element-wise kernels at an achieved bandwidth, ring all-reduces with a bandwidth and a per-step
latency. This module measures those rates here (:func:`measure`), writes them as a
:class:`~meshtron.plan.cluster.Cluster` (:func:`calibrate`), and predicts the step time of a
meshtron :class:`~meshtron.config.Config` with the same terms (:func:`predict`); the benchmark
``benchmarks/plan_calibration.py`` holds the prediction against measured runs.

**The machine.** ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` makes eight CPU "devices" in
one process, and they share the machine's cores (two on the development machine). A device is not a
GPU with its own arithmetic units: while all eight compute, each gets an eighth of the machine, and
when some idle the others speed up (an idle device lends its core), up to what one device can use
alone. Hence:

* every rate of the :class:`~meshtron.plan.cluster.Cluster` this module writes is **one device's
  share while all devices run** (the measured aggregate divided by the device count). The plan's
  per-device seconds are then wall-clock seconds whenever every device is busy, which is the
  common case: data and tensor parallelism keep all devices in step;
* a pipeline's idle slots are *not* lost time as on a GPU: a tick in which some stages idle runs the
  busy ones faster. :func:`shared_wall` prices one lockstep tick as processor sharing -- the
  machine's capacity spread over the busy devices, each capped at its speed alone
  (:attr:`CpuMesh.gemm_alone`, :attr:`CpuMesh.elementwise_alone`, measured) -- so a bubble costs
  wall time only where too few devices are busy to fill the cores (one device per stage, or a
  two-device mesh with one device per core). The ``bubble`` term is that extra time;
* collectives are measured *between* compute (a GEMM pair, then the collective), as the runs call
  them: their cost includes the rendezvous of devices that time-share cores.

**What differs from Megatron-LM's runtime, and is priced as meshtron runs:** fp32 activations
(:data:`ELEMENT_BYTES`), no dropout (:data:`MESHTRON_PASSES`: Megatron's fused-kernel counts of
:data:`~meshtron.plan.timing.ELEMENTWISE_PASSES` without the dropout masks), the lockstep schedule
tables of :mod:`meshtron.pipeline.schedules` run tick by tick (their ticks and the runtime's
``ppermute`` sends are read from the compiled :class:`~meshtron.pipeline.schedules.Program` and
:func:`meshtron.pipeline.runtime.segments`, not the ``(p−1)/(v·m)`` formula), whole activations sent
between stages (no scatter/gather), the pipeline's default recomputation (``parallel.recompute``:
the backward reruns the stage, the LM head included), and two costs Megatron does not have:

* **residuals** -- autodiff of the ``scan`` over stacked layers keeps each layer's residuals
  (meshtron's own count, :func:`meshtron.megatron.layer_activation_bytes`) in ``[layers, ...]``
  stacks that are zero-filled, written and read back (:data:`RESIDUAL_PASSES`, counted in the
  compiled HLO), at the element-wise bandwidth;
* **allocation** -- XLA's CPU runtime allocates a step's temporaries afresh at every execution, and a
  buffer above glibc's mmap threshold (:data:`MMAP_THRESHOLD_BYTES`, the largest the dynamic
  threshold reaches) is mapped anew, so the kernel zero-fills every page again on first touch
  (``ru_minflt`` per step is the compiled program's temp size times the device count). Priced at the
  measured first-touch rate (:attr:`CpuMesh.first_touch_gbps`).

Not priced (small here, or not measured apart): the embedding's gather and scatter-add, the
per-tick slicing of a chunk's parameters and accumulation of its gradients, the runtime's stash
copies, layout transposes around the attention core, and the time cores sit idle while device
threads wait at a rendezvous (``getrusage`` over the runs: 1.8 to 1.9 of the 2 cores busy), so
predictions lean low (0.82 to 0.96 of the measured step in five runs of the benchmark on the
development machine).

Nothing is fitted to the runs. Every rate is a micro-measurement of :func:`measure` (the only fits:
bandwidth and latency of each collective, to its own measurements), every count comes from the
plan's model, meshtron's activation count, the schedule table or the compiled program, and the pass
counts (:data:`MESHTRON_PASSES`, :data:`RESIDUAL_PASSES`) from reading the kernels, not from the
runs' times. A calibration holds for the device count it measured (the sharing depends on it).
Measuring needs JAX (imported inside :func:`measure`); calibrating is pure Python, and so is
predicting a run without a pipeline (a pipelined one asks the runtime for its segments, which
imports JAX).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from meshtron import megatron
from meshtron.config import Config, padded_vocab_size
from meshtron.errors import ConfigError
from meshtron.models.gpt_counts import BLOCK as GPT_BLOCK
from meshtron.pipeline.program import Program
from meshtron.plan.cluster import Cluster, cluster_from_dict
from meshtron.plan.model import Layout, ModelShape, figures
from meshtron.plan.timing import (
    allreduce_seconds,
    data_seconds,
    layer_gemm_seconds,
    layer_memory_seconds,
    logits_seconds,
    optimizer_seconds,
)
from meshtron.run import resolve_run

__all__ = [
    "ELEMENT_BYTES",
    "GEMM_SIZES",
    "MESHTRON_PASSES",
    "MMAP_THRESHOLD_BYTES",
    "RESIDUAL_PASSES",
    "TERMS",
    "CpuMesh",
    "Measurements",
    "Prediction",
    "StageWork",
    "calibrate",
    "cluster_to_dict",
    "kept_bytes",
    "layout_of",
    "measure",
    "predict",
    "program_of",
    "shared_wall",
    "tick_sends",
]

ELEMENT_BYTES = 4
"""meshtron trains in fp32 on CPU (``model.dtype``): activations, gradients and their all-reduces are
4-byte elements, where the plan counts Megatron's 16-bit ones (:data:`~meshtron.plan.model.ACTIVATION_BYTES`)."""

MESHTRON_PASSES = {"residual": (10.0, 12.0), "mlp": (2.0, 3.0), "scores": (2.0, 3.0)}
"""Elements one meshtron layer reads and writes outside its GEMMs, per token and unit of width
(forward, backward): :data:`meshtron.plan.timing.ELEMENTWISE_PASSES` without dropout, which
meshtron's blocks do not have -- ``residual`` loses the two bias-dropout-adds' masks (0.5 each
forward) and the dropouts' backward (2.5 each), ``scores`` the attention dropout (2.5 each way)."""

RESIDUAL_PASSES = (3.0, 2.0)
"""Passes over a layer's kept residuals (:func:`meshtron.megatron.layer_activation_bytes`) that XLA's
``scan`` over the stacked layers adds, counted in the optimized HLO of meshtron's step: forward, the
``[layers, ...]`` stack is zero-filled before the loop (a ``broadcast``, or a ``copy`` of one: one
write) and each residual is read and written into it (``dynamic-update-slice``: two); backward, each
is read out of the stack into a temporary (``dynamic-slice``: two)."""

LOSS_PASSES = (2.0, 3.0)
"""The vocab-parallel cross-entropy over the ``b·s·V/t`` fp32 logits: log-softmax forward (read,
write), backward (read the probabilities and the gradient, write)."""

MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit Linux: freed mappings raise the dynamic mmap
threshold up to this, so smaller temporaries come back from the heap, already paged in, while
larger ones are mapped (and page-faulted) anew at every step."""

GEMM_SIZES = (16, 32, 64, 128, 256, 512)
WORK_TERMS = ("gemm", "elementwise", "residuals", "tensor", "pipe")
TERMS = ("gemm", "elementwise", "residuals", "tensor", "pipe", "bubble", "data", "optimizer", "allocation")


# ----------------------------------------------------------------------------------------------
# The machine


@dataclass(frozen=True)
class Measurements:
    """Raw per-operation costs of the simulated mesh (:func:`measure`). Rates are aggregates over
    ``devices`` devices running the operation at once (``alone``: one device, the others idle).

    ``gemm``: (smallest dimension, FLOP/s) of a dense layer's forward and backward (three GEMMs);
    ``gemm_alone``: the same at :attr:`alone_dimension` on one device. ``elementwise``: (kernel,
    counted bytes, seconds) of ``elementwise_reps`` forward-and-backward calls of a layer norm, a
    GeLU and a softmax on every device, the bytes counted as :data:`MESHTRON_PASSES` counts them
    (2 passes forward, 3 backward); ``elementwise_alone``: seconds of one call of each on one
    device. ``first_touch``: (bytes, seconds) of writing fresh buffers minus writing warm ones.
    ``allreduce``: (group, bytes, seconds) and ``ppermute``: (bytes, seconds) of one collective
    between two GEMMs, minus the GEMMs alone."""

    devices: int
    cores: int
    memory_bytes: float
    gemm: tuple[tuple[int, float], ...]
    alone_dimension: int
    gemm_alone: float
    elementwise: tuple[tuple[str, float, float], ...]
    elementwise_alone: tuple[float, ...]
    first_touch: tuple[float, float]
    elementwise_reps: int
    allreduce: tuple[tuple[int, float, float], ...]
    ppermute: tuple[tuple[float, float], ...]
    seconds: float = 0.0  # how long measuring took

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Measurements:
        tuples = {
            "gemm": lambda rows: tuple((int(x), float(r)) for x, r in rows),
            "elementwise": lambda rows: tuple((str(k), float(b), float(s)) for k, b, s in rows),
            "elementwise_alone": lambda rows: tuple(float(s) for s in rows),
            "first_touch": lambda row: (float(row[0]), float(row[1])),
            "allreduce": lambda rows: tuple((int(g), float(b), float(s)) for g, b, s in rows),
            "ppermute": lambda rows: tuple((float(b), float(s)) for b, s in rows),
        }
        return cls(**{k: tuples[k](v) if k in tuples else v for k, v in values.items()})


@dataclass(frozen=True)
class CpuMesh:
    """The simulated mesh as the planner sees it.

    ``cluster``: one device's share of the machine while all ``devices`` run (see the module
    docstring) -- a :class:`~meshtron.plan.cluster.Cluster` like the bundled GPU ones, one node of
    ``devices`` GPUs joined by "NVLink" (the process's in-memory collectives).
    ``gemm_alone`` / ``elementwise_alone``: how many times faster one device runs that kind of work
    alone than in the crowd (at most ``devices``: a device alone has the whole machine; about
    ``devices / cores`` if one device used one core). ``first_touch_gbps``: one device's share of
    the rate at which fresh pages are zero-filled. ``p2p_*``: one ``ppermute`` (every device sends
    one message to its neighbour) -- bandwidth per device and latency.
    """

    cluster: Cluster
    devices: int
    cores: int
    gemm_alone: float
    elementwise_alone: float
    first_touch_gbps: float
    p2p_gbps: float
    p2p_latency_us: float

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["cluster"] = cluster_to_dict(self.cluster)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CpuMesh:
        """Inverse of :meth:`to_dict`, also after a JSON round trip (which makes the GEMM table's
        integer keys strings)."""
        values = dict(values)
        cluster = dict(values["cluster"])
        efficiency = dict(cluster.get("efficiency") or {})
        if isinstance(efficiency.get("gemm"), dict):
            efficiency["gemm"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                                  for k, v in efficiency["gemm"].items()}
            cluster["efficiency"] = efficiency
        values["cluster"] = cluster_from_dict(cluster, "calibration")
        return cls(**values)


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The fields of a cluster file (YAML-ready): ``cluster_from_dict(cluster_to_dict(c), ...) == c``."""
    values = {name: getattr(cluster, name) for name in (
        "name", "description", "gpus_per_node", "peak_tflops", "memory_gb", "reserved_gb", "hbm_gbps",
        "nvlink_gbps", "nvlink_latency_us", "network_gbps", "network_latency_us")}
    values["efficiency"] = {
        "gemm": {int(size): float(value) for size, value in cluster.gemm_efficiency},
        "memory": cluster.memory_efficiency, "nvlink": cluster.nvlink_efficiency,
        "network": cluster.network_efficiency,
    }
    return values


def _ring_fit(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """(bandwidth B/s, latency s) of ``t = 2(g−1)·latency + 2(g−1)/g · bytes / bandwidth``, least
    squares in relative error over (group g, bytes, seconds) samples; latency clamped at >= 0."""
    rows = [(2 * (g - 1) / s, 2 * (g - 1) / g * nbytes / s) for g, nbytes, s in samples]
    return _two_term_fit(rows)


def _two_term_fit(rows: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Solve ``a·x + b·y ≈ 1`` (rows of (x, y), relative errors) for (1/b, a) with a, b >= 0."""
    sxx = sum(x * x for x, _ in rows)
    syy = sum(y * y for _, y in rows)
    sxy = sum(x * y for x, y in rows)
    sx = sum(x for x, _ in rows)
    sy = sum(y for _, y in rows)
    det = sxx * syy - sxy * sxy
    a = (sx * syy - sy * sxy) / det if det else 0.0
    b = (sy * sxx - sx * sxy) / det if det else 0.0
    if a < 0 or b <= 0:  # latency-free fit
        a, b = 0.0, sy / syy
    return 1.0 / b, a


def calibrate(measured: Measurements, name: str = "cpu-mesh") -> CpuMesh:
    """Turn :class:`Measurements` into a :class:`CpuMesh` (no fitting beyond the collectives' two
    constants each): peak = the fastest GEMM rate of the table, the efficiency table = each size's
    rate over it, the element-wise bandwidth = the kernels' counted bytes over their time, all
    divided by the device count (one device's share)."""
    n = measured.devices
    peak = max(rate for _, rate in measured.gemm)
    table = {int(x): round(min(1.0, rate / peak), 4) for x, rate in measured.gemm}
    counted = sum(nbytes for _, nbytes, _ in measured.elementwise)
    spent = sum(seconds for _, _, seconds in measured.elementwise)
    bandwidth = counted / spent  # aggregate over the devices
    ar_bw, ar_latency = _ring_fit(measured.allreduce)
    pp_bw, pp_latency = _two_term_fit([(1 / s, nbytes / s) for nbytes, s in measured.ppermute])
    shared_gemm = dict(measured.gemm)[measured.alone_dimension] / n
    gemm_alone = min(float(n), max(1.0, measured.gemm_alone / shared_gemm))
    per_call = spent / measured.elementwise_reps  # every device ran each kernel once per call
    elementwise_alone = min(float(n), max(1.0, per_call / sum(measured.elementwise_alone)))
    first_bytes, first_seconds = measured.first_touch
    cluster = cluster_from_dict({
        "name": name,
        "description": (f"{n} simulated XLA CPU devices on {measured.cores} cores; every rate is one device's "
                        f"share while all {n} run (meshtron.plan.calibration)"),
        "gpus_per_node": n,
        "peak_tflops": peak / n / 1e12,
        "memory_gb": measured.memory_bytes / n / 1e9,
        "reserved_gb": 0,
        "hbm_gbps": bandwidth / n / 1e9,
        "nvlink_gbps": ar_bw / 1e9,
        "nvlink_latency_us": ar_latency * 1e6,
        "network_gbps": ar_bw / 1e9,  # one host: no network; never used while gpus <= gpus_per_node
        "network_latency_us": ar_latency * 1e6,
        "efficiency": {"gemm": table, "memory": 1.0, "nvlink": 1.0, "network": 1.0},
    }, "calibration")
    return CpuMesh(cluster=cluster, devices=n, cores=measured.cores, gemm_alone=gemm_alone,
                   elementwise_alone=elementwise_alone, first_touch_gbps=first_bytes / first_seconds / n / 1e9,
                   p2p_gbps=pp_bw / 1e9, p2p_latency_us=pp_latency * 1e6)


# ----------------------------------------------------------------------------------------------
# Measuring (JAX)


def measure(devices: Sequence[Any] | None = None, *, repeats: int = 5, log: Callable[[str], None] | None = None,
            ) -> Measurements:
    """Time the operations the model prices, on every device at once (``shard_map`` over a 1-D mesh
    of ``devices``, default all), each inside a ``fori_loop`` so one dispatch covers several; the
    median of ``repeats`` rounds, the cases of a kind interleaved round by round so that a change of
    load on a shared machine hits them alike. About half a minute on the 2-core machine."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    say = log or (lambda _: None)
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    start = time.perf_counter()

    def mesh_of(count: int, group: int = 1) -> Mesh:
        return Mesh(np.array(devices[:count]).reshape(count // group, group), ("r", "g"))

    def sharded(fn, mesh: Mesh, *arrays):
        spec = P(("r", "g"))
        compiled = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec,
                                         check_vma=False))
        placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]
        jax.block_until_ready(compiled(*placed))  # compile and warm up
        return lambda: jax.block_until_ready(compiled(*placed))

    def rounds(cases: dict[Any, Callable[[], Any]], count: int) -> dict[Any, list[float]]:
        times: dict[Any, list[float]] = {key: [] for key in cases}
        for _ in range(count):
            for key, run in cases.items():
                begin = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - begin)
        return times

    def medians(cases: dict[Any, Callable[[], Any]]) -> dict[Any, float]:
        return {key: statistics.median(values) for key, values in rounds(cases, repeats).items()}

    reps = 8

    # GEMMs: a dense layer x[T, a] @ w[a, c], forward and both backward GEMMs, for a = x (c = W) and
    # c = x (a = W): the smallest dimension is x, on the input or the output side.
    tokens, width = 1024, 256

    def dense(count: int, a: int, c: int):
        def body(x, w):
            def step(_, carry):
                y, pullback = jax.vjp(jnp.matmul, *carry)
                return pullback(y)
            return jax.lax.fori_loop(0, reps, step, (x, w))[0]

        # constant operands at the fixed point of (x, w) -> pullback(x @ w): the values never drift
        # towards overflow or denormals. One shard_map block is one device's operands.
        x = np.full((count * tokens, a), 1.0 / math.sqrt(tokens * a), np.float32)
        w = np.full((count * a, c), 1.0 / math.sqrt(a * c), np.float32)
        return sharded(body, mesh_of(count), x, w), count * reps * 6 * tokens * a * c

    def shapes(x: int) -> list[tuple[int, int]]:
        other = max(width, x)
        return [(x, other), (other, x)] if other != x else [(x, x)]

    alone_dimension = 128
    cases, flops = {}, {}
    for x in GEMM_SIZES:
        for a, c in shapes(x):
            cases[(n, x, a, c)], flops[(n, x, a, c)] = dense(n, a, c)
    for a, c in shapes(alone_dimension):
        cases[(1, alone_dimension, a, c)], flops[(1, alone_dimension, a, c)] = dense(1, a, c)
    seconds = medians(cases)

    def rate(count: int, x: int) -> float:
        keys = [k for k in seconds if k[:2] == (count, x)]
        return sum(flops[k] for k in keys) / sum(seconds[k] for k in keys)

    gemm = [(x, rate(n, x)) for x in GEMM_SIZES]
    gemm_alone = rate(1, alone_dimension)
    say("gemm FLOP/s (all devices): " + ", ".join(f"{x}: {r / 1e9:.0f}G" for x, r in gemm)
        + f"; one device alone at {alone_dimension}: {gemm_alone / 1e9:.0f}G")

    # Element-wise kernels, forward + backward (jax.vjp), one per class of MESHTRON_PASSES, with
    # that class's pass count: a layer norm (residual stream), GeLU (MLP), softmax (scores).
    def layer_norm(x):
        mean = x.mean(-1, keepdims=True)
        centred = x - mean
        return centred * jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + 1e-5)

    kernels = {
        "layer_norm": (layer_norm, (tokens, 128)),
        "gelu": (jax.nn.gelu, (tokens, 512)),
        "softmax": (lambda x: jax.nn.softmax(x, axis=-1), (8, 8, 128, 128)),
    }

    def elementwise(count: int, fn, shape):
        def body(x, cotangent):  # a fixed cotangent: y itself is annihilated by a layer norm's pullback
            def step(_, x):
                _, pullback = jax.vjp(fn, x)
                return pullback(cotangent)[0]
            return jax.lax.fori_loop(0, reps, step, x)

        draw = np.random.default_rng(0).standard_normal
        full = (count * shape[0], *shape[1:])
        return sharded(body, mesh_of(count), draw(full).astype(np.float32), draw(full).astype(np.float32))

    cases = {}
    for name, (fn, shape) in kernels.items():
        cases[(name, n)] = elementwise(n, fn, shape)
        cases[(name, 1)] = elementwise(1, fn, shape)
    seconds = medians(cases)
    passes = sum(MESHTRON_PASSES["scores"])  # 5 for each kernel: (2 forward, 3 backward) elements
    rows = tuple((name, n * reps * passes * math.prod(shape) * ELEMENT_BYTES, seconds[(name, n)])
                 for name, (_, shape) in kernels.items())
    alone = tuple(seconds[(name, 1)] / reps for name in kernels)
    say("element-wise GB/s (all devices): " + ", ".join(f"{k}: {b / s / 1e9:.1f}" for k, b, s in rows))

    # First touch: a fresh 64 MiB output per device per call, minus the same kernel on warm memory.
    elements = 16 * 2**20

    def fresh(x):
        return x * 0.5 + 1.0

    def warm(x):
        return jax.lax.fori_loop(0, reps, lambda _, x: x * 0.5 + 1.0, x)

    big = np.ones((n * elements,), np.float32)
    seconds = medians({"fresh": sharded(fresh, mesh_of(n), big), "warm": sharded(warm, mesh_of(n), big)})
    touched = n * elements * ELEMENT_BYTES
    first = max(seconds["fresh"] - seconds["warm"] / reps, 1e-9)
    say(f"first touch: {touched / first / 1e9:.1f} GB/s (all devices)")
    del big

    # Collectives between compute, as a step calls them: x -> tanh(x @ w1) @ w2 -> collective.
    def between(group: int, rows_: int, collective):
        hidden, inner = 128, 256

        def body(x, w1, w2):
            def step(_, x):
                return collective(jnp.tanh(x @ w1) @ w2) * 0.5
            return jax.lax.fori_loop(0, reps, step, x)

        x = np.full((n * rows_, hidden), 0.01, np.float32)
        w1 = np.full((n * hidden, inner), 0.01, np.float32)
        w2 = np.full((n * inner, hidden), 0.01, np.float32)
        return sharded(body, mesh_of(n, group), x, w1, w2)

    ring = [(i, (i + 1) % n) for i in range(n)]
    cases = {}
    for rows_ in (512, 2048):  # activations of 0.26 and 1 MB
        cases[("none", n, rows_)] = between(n, rows_, lambda y: y)
        for group in (2, 4, n):
            cases[("all-reduce", group, rows_)] = between(group, rows_, lambda y: jax.lax.psum(y, "g"))
        cases[("ppermute", n, rows_)] = between(n, rows_, lambda y: jax.lax.ppermute(y, "g", ring))
    # a collective's cost: the median over rounds of (with it - without it), timed within one round
    times = rounds(cases, 2 * repeats)

    def cost(key) -> float:
        base = times[("none", n, key[2])]
        return max(statistics.median(a - b for a, b in zip(times[key], base)) / reps, 1e-7)

    def size(key) -> float:
        return float(key[2] * 128 * ELEMENT_BYTES)

    allreduce = tuple((key[1], size(key), cost(key)) for key in cases if key[0] == "all-reduce")
    ppermute = tuple((size(key), cost(key)) for key in cases if key[0] == "ppermute")
    say("all-reduce us: " + ", ".join(f"g={g} {b / 1e6:.2f}MB {s * 1e6:.0f}" for g, b, s in allreduce)
        + "; ppermute us: " + ", ".join(f"{b / 1e6:.2f}MB {s * 1e6:.0f}" for b, s in ppermute))

    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        memory = 8e9
    return Measurements(
        devices=n, cores=os.cpu_count() or 1, memory_bytes=memory, gemm=tuple(gemm),
        alone_dimension=alone_dimension, gemm_alone=gemm_alone, elementwise=rows, elementwise_alone=alone,
        elementwise_reps=reps,
        first_touch=(float(touched), float(first)), allreduce=allreduce, ppermute=ppermute,
        seconds=time.perf_counter() - start,
    )


# ----------------------------------------------------------------------------------------------
# Predicting a meshtron run


def shared_wall(works: Sequence[float], caps: Sequence[float], per_stage: int, devices: int) -> float:
    """Wall time of one lockstep tick on a machine whose devices share its cores.

    ``works[i]``: what each of stage ``i``'s ``per_stage`` devices does this tick, in seconds of a
    device's share while all ``devices`` run; ``caps[i]``: how many times faster than that it can go
    alone. The machine delivers ``devices`` shares per second, spread evenly over the busy devices
    (processor sharing, as the OS schedules the device threads), none faster than its cap; a device
    that finishes lends its share to the rest. All devices busy: the busiest stage's work, as on a
    GPU; one of eight busy: its work / min(cap, 8)."""
    busy = [(w, c) for w, c in zip(works, caps) if w > 0]
    wall = 0.0
    while busy:
        level = _water_level([c for _, c in busy], per_stage, devices)
        rates = [min(c, level) for _, c in busy]
        step = min(w / r for (w, _), r in zip(busy, rates))
        wall += step
        # the stage(s) that finish now leave; the others carry what they have left
        busy = [(w - r * step, c) for (w, c), r in zip(busy, rates) if w / r > step * (1 + 1e-12)]
    return wall


def _water_level(caps: Sequence[float], per_stage: int, devices: int) -> float:
    """The per-device speed ``L`` at which busy devices, each at ``min(cap, L)``, use the machine's
    ``devices`` shares (or every cap, when their sum is less)."""
    if per_stage * sum(caps) <= devices:
        return max(caps)
    remaining, left = float(devices), len(caps)
    for cap in sorted(caps):
        if cap * left * per_stage >= remaining:
            return remaining / (left * per_stage)
        remaining -= cap * per_stage
        left -= 1
    return max(caps)  # pragma: no cover - covered by the first test


@dataclass(frozen=True)
class StageWork:
    """Seconds of one device's share for one piece of work, by term (:data:`WORK_TERMS`); GEMMs
    and the rest speed up differently when the device runs alone (:meth:`cap`)."""

    gemm: float = 0.0
    elementwise: float = 0.0
    residuals: float = 0.0
    tensor: float = 0.0
    pipe: float = 0.0

    def __add__(self, other: StageWork) -> StageWork:
        return StageWork(*(a + b for a, b in zip(self.parts, other.parts)))

    def scaled(self, factor: float) -> StageWork:
        return StageWork(*(a * factor for a in self.parts))

    @property
    def parts(self) -> tuple[float, ...]:
        return (self.gemm, self.elementwise, self.residuals, self.tensor, self.pipe)

    @property
    def total(self) -> float:
        return sum(self.parts)

    def cap(self, machine: CpuMesh) -> float:
        """Speed-up alone: GEMMs at ``gemm_alone``, the rest at ``elementwise_alone`` (time-weighted)."""
        other = self.total - self.gemm
        alone = self.gemm / machine.gemm_alone + other / machine.elementwise_alone
        return self.total / alone if alone > 0 else 1.0


@dataclass(frozen=True)
class Prediction:
    """A meshtron run's predicted step: ``seconds`` by term (:data:`TERMS`, adding up to
    ``step_seconds``), the plan's :class:`~meshtron.plan.model.Layout` and shape it priced, the
    schedule's lockstep ``ticks`` and the runtime's ``ppermute`` sends per device (``m`` and 0
    without a pipeline)."""

    model: ModelShape
    layout: Layout
    schedule: str | None
    step_seconds: float
    seconds: dict[str, float] = field(default_factory=dict)
    ticks: int = 0
    sends: int = 0
    temp_bytes: float = 0.0


def layout_of(cfg: Config, devices: int = 8) -> tuple[ModelShape, Layout]:
    """The plan's view of a meshtron config: the GPT's shape (vocabulary padded as meshtron pads it,
    to 128·t) and the layout (``b = B/(d·m)``; recomputation ``full`` when the pipeline recomputes
    its stages, else ``model.remat``). Sequence parallelism, uneven stage layouts and other model
    families are not modelled (:class:`~meshtron.config.ConfigError`)."""
    sizes = [cfg.mesh.data, cfg.mesh.pipe, cfg.mesh.tensor]
    if sizes.count(-1) == 1:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = devices // known
    d, p, t = sizes
    model = cfg.model
    if model.family != "gpt" or model.factory is not None:
        raise ConfigError("model.family: the calibration prices meshtron's GPT (the plan's model)")
    if model.mlp_dim != 4 * model.hidden:
        raise ConfigError(f"model.mlp_dim: the plan's formulas assume 4 x hidden = {4 * model.hidden}")
    if model.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel: not modelled by the calibration; turn it off")
    if p > 1 and cfg.pipeline.layout is not None:
        raise ConfigError("parallel.layout: uneven stages are not modelled by the calibration")
    shape = ModelShape(model.layers, model.hidden, model.heads, model.seq_len, padded_vocab_size(model.vocab_size, t))
    m, batch = cfg.train.microbatches, cfg.train.batch_size
    chunks = cfg.pipeline.chunks if p > 1 else 1
    recompute = "full" if p > 1 and cfg.pipeline.recompute else model.remat
    layout = Layout(tensor=t, pipe=p, data=d, microbatch=batch // (d * m), global_batch=batch, chunks=chunks,
                    recompute=recompute)
    layout.check(shape)
    return shape, layout


def program_of(cfg: Config, pipe: int) -> Program:
    """The compiled schedule a run of ``cfg`` executes (the trainer's resolved run)."""
    mesh = cfg.mesh
    return resolve_run(cfg, mesh.data * pipe * mesh.tensor).program


def tick_sends(program: Program) -> list[tuple[bool, bool]]:
    """Per tick, whether the runtime runs the forward and the backward ``ppermute``: the flags of
    the segment holding it (:func:`meshtron.pipeline.runtime.segments`, which merges neighbouring
    segments, so some ticks send though the table has nothing to send)."""
    from meshtron.pipeline.runtime import segments  # imports JAX; the runtime's own segmentation

    flags = [(False, False)] * program.schedule.ticks
    for seg in segments(program):
        for tick in range(seg.start, seg.stop):
            flags[tick] = (seg.send_forward, seg.send_backward)
    return flags


def kept_bytes(cfg: Config, model: ModelShape, layout: Layout) -> float:
    """Activation bytes a device holds at its fullest, by meshtron's own count (not Megatron's): every
    layer's residuals (:func:`meshtron.megatron.layer_activation_bytes`, ``model.remat``) without a
    pipeline; with one, the stash of stage inputs and one chunk's residuals
    (:func:`meshtron.megatron.pipeline_activation_bytes`, the compiled program's ``stash_slots``), or
    every in-flight chunk's residuals when the pipeline keeps them (``residual_slots``). XLA's temp
    allocation is at least this (what :func:`predict` prices when not given the compiled size)."""
    s, b, h, t = model.seq_len, layout.microbatch, model.hidden, layout.tensor
    layer = megatron.layer_activation_bytes(seq_len=s, microbatch=b, hidden=h, heads=model.heads, tensor=t,
                                            remat=cfg.model.remat, bytes_per_element=ELEMENT_BYTES,
                                            block=GPT_BLOCK)
    if layout.pipe == 1:
        return model.layers * layer
    program = program_of(cfg, layout.pipe)
    per_chunk = model.layers // (layout.pipe * layout.chunks)
    if program.keeps_residuals:
        return program.stash_slots * s * b * h * ELEMENT_BYTES + program.residual_slots * per_chunk * layer
    return megatron.pipeline_activation_bytes(layer_bytes=layer, input_bytes=s * b * h * ELEMENT_BYTES,
                                              layers_per_chunk=per_chunk, in_flight=program.stash_slots)


def _layer_work(model: ModelShape, layout: Layout, cluster: Cluster, remat: str, stage_recompute: bool
                ) -> tuple[StageWork, StageWork]:
    """One layer's forward and backward (the recomputed forward included) for one microbatch.

    ``remat``: ``model.remat``, what autodiff keeps of a layer for its backward
    (:func:`meshtron.megatron.layer_activation_bytes`); those residuals go through a ``[layers, ...]``
    stack of the ``scan`` over layers: :data:`RESIDUAL_PASSES` at the element-wise bandwidth, in the
    backward tick when the pipeline recomputes the stage (``stage_recompute``), else split between
    the forward (into the stack) and the backward (out of it)."""
    none = replace(layout, recompute="none")
    full = replace(layout, recompute="full")
    gemm_forward = layer_gemm_seconds(model, none, cluster) / 3  # "none" runs 3 forward-equivalents
    gemm = layer_gemm_seconds(model, layout, cluster)

    def memory(lay: Layout) -> float:
        return layer_memory_seconds(model, lay, cluster, passes=MESHTRON_PASSES, element_bytes=ELEMENT_BYTES)

    elem_forward = memory(full) - memory(none)
    elem = memory(layout)
    t = layout.tensor
    one = 0.0
    if t > 1:
        one = allreduce_seconds(layout.microbatch * model.seq_len * model.hidden * ELEMENT_BYTES, t, t, cluster)
    per_layer = figures(model, layout).tensor_allreduces_per_layer
    kept = megatron.layer_activation_bytes(seq_len=model.seq_len, microbatch=layout.microbatch, hidden=model.hidden,
                                           heads=model.heads, tensor=t, remat=remat, bytes_per_element=ELEMENT_BYTES,
                                           block=GPT_BLOCK)
    stacked = kept / (cluster.hbm_gbps * 1e9 * cluster.memory_efficiency)
    into, out_of = RESIDUAL_PASSES
    forward = StageWork(gemm=gemm_forward, elementwise=elem_forward, residuals=0.0 if stage_recompute else into * stacked,
                        tensor=2 * one if t > 1 else 0.0)
    backward = StageWork(gemm=gemm - gemm_forward, elementwise=elem - elem_forward,
                         residuals=(out_of + into * stage_recompute) * stacked,
                         tensor=(per_layer - 2) * one if t > 1 else 0.0)
    return forward, backward


def _ends_work(model: ModelShape, layout: Layout, cluster: Cluster, recomputed: bool
               ) -> tuple[StageWork, StageWork, StageWork]:
    """(embedding forward, head + loss forward, head + loss backward) of one microbatch: the LM
    head's GEMMs (:func:`~meshtron.plan.timing.logits_seconds`: one third forward), the loss over
    the fp32 logits (:data:`LOSS_PASSES`), and the tensor all-reduces -- the embedding's sum over
    vocabulary shards, the loss's three of ``b·s``, the head's input gradient. ``recomputed``: the
    backward reruns the head's forward (the pipeline's recomputation)."""
    b, s, h, t = layout.microbatch, model.seq_len, model.hidden, layout.tensor
    head = logits_seconds(model, layout, cluster)
    bandwidth = cluster.hbm_gbps * 1e9 * cluster.memory_efficiency
    logits = b * s * model.vocab_size / t * ELEMENT_BYTES / bandwidth
    big = small = 0.0
    if t > 1:
        big = allreduce_seconds(b * s * h * ELEMENT_BYTES, t, t, cluster)
        small = allreduce_seconds(b * s * ELEMENT_BYTES, t, t, cluster)
    embed = StageWork(tensor=big)
    forward = StageWork(gemm=head / 3, elementwise=LOSS_PASSES[0] * logits, tensor=3 * small)
    again = forward if recomputed else StageWork()
    backward = again + StageWork(gemm=2 * head / 3, elementwise=LOSS_PASSES[1] * logits, tensor=big)
    return embed, forward, backward


def predict(cfg: Config, machine: CpuMesh, temp_bytes: float | None = None) -> Prediction:
    """The step time of a meshtron run of ``cfg`` on ``machine``, term by term.

    Each lockstep tick of the compiled schedule (``m`` ticks of the whole model without a
    pipeline) gives every stage its work -- the forward and backward of its chunk's layers
    (:func:`~meshtron.plan.timing.layer_gemm_seconds`, :func:`~meshtron.plan.timing.layer_memory_seconds`,
    tensor all-reduces by :func:`~meshtron.plan.timing.allreduce_seconds`), the embedding on the
    first virtual stage, the head and loss on the last -- plus the ``ppermute`` sends of that tick
    (:func:`tick_sends`); :func:`shared_wall` turns it into wall time. Then the step's data-parallel
    all-reduce and optimizer update (:func:`~meshtron.plan.timing.data_seconds`,
    :func:`~meshtron.plan.timing.optimizer_seconds`), and the allocation term: ``temp_bytes`` per
    device (the compiled program's ``memory_analysis().temp_size_in_bytes``; by default
    :func:`kept_bytes`, meshtron's count of the activations, which XLA's temporaries exceed by the
    step's other buffers) zero-filled by the kernel at every step when above :data:`MMAP_THRESHOLD_BYTES`.

    The gemm/elementwise/tensor/pipe terms are the ticks' work spread over all devices (what a
    fully shared machine takes); ``bubble`` is the rest of the ticks' wall time."""
    cluster = machine.cluster
    model, layout = layout_of(cfg, machine.devices)
    d, p, t, v = layout.data, layout.pipe, layout.tensor, layout.chunks
    m = layout.microbatches
    if d * p * t != machine.devices:
        raise ConfigError(f"mesh: {d}x{p}x{t} devices, but the calibration measured {machine.devices}")
    stage_recompute = p > 1 and cfg.pipeline.recompute
    layer_f, layer_b = _layer_work(model, layout, cluster, cfg.model.remat, stage_recompute)
    embed, head_f, head_b = _ends_work(model, layout, cluster, recomputed=stage_recompute)
    if p == 1:  # m ticks of the whole model on every device (gradient accumulation)
        rows = [[(layer_f + layer_b).scaled(model.layers) + embed + head_f + head_b]] * m
        ticks, sends = m, 0
    else:
        program = program_of(cfg, p)
        if program.schedule.split_backward:
            raise ConfigError("parallel.schedule: split-backward (zero-bubble) tables are not modelled by the "
                              "calibration")
        per_chunk, last = model.layers // (p * v), p * v - 1
        message = layout.microbatch * model.seq_len * model.hidden * ELEMENT_BYTES
        send = StageWork(pipe=machine.p2p_latency_us * 1e-6 + message / (machine.p2p_gbps * 1e9))
        flags = tick_sends(program)
        ticks, sends = program.schedule.ticks, sum(int(f) + int(b) for f, b in flags)
        rows = []
        for tick, (send_f, send_b) in enumerate(flags):
            row = []
            for stage in range(p):
                work = send.scaled(int(send_f) + int(send_b))  # every stage takes part in a tick's ppermute
                if program.fwd_mb[tick, stage] >= 0:
                    k = int(program.fwd_chunk[tick, stage]) * p + stage  # virtual stage
                    work += layer_f.scaled(per_chunk) + (embed if k == 0 else StageWork()) \
                        + (head_f if k == last else StageWork())
                if program.bwd_mb[tick, stage] >= 0:
                    k = int(program.bwd_chunk[tick, stage]) * p + stage
                    work += layer_b.scaled(per_chunk) + (head_b if k == last else StageWork())
                row.append(work)
            rows.append(row)
    terms = dict.fromkeys(TERMS, 0.0)
    walls = 0.0
    for row in rows:
        walls += shared_wall([w.total for w in row], [w.cap(machine) for w in row], d * t, machine.devices)
        for name in WORK_TERMS:  # the tick's work spread over every device
            terms[name] += sum(getattr(w, name) for w in row) / len(row)
    terms["bubble"] = max(0.0, walls - sum(terms[k] for k in WORK_TERMS))  # >= 0 but for rounding
    optimizer = cfg.train.optimizer
    terms["data"] = data_seconds(model, layout, cluster, optimizer)
    terms["optimizer"] = optimizer_seconds(model, layout, cluster, optimizer)
    if temp_bytes is None:
        temp_bytes = kept_bytes(cfg, model, layout)
    if temp_bytes > MMAP_THRESHOLD_BYTES:
        terms["allocation"] = temp_bytes / (machine.first_touch_gbps * 1e9)
    schedule = cfg.pipeline.schedule if p > 1 else None
    return Prediction(model=model, layout=layout, schedule=schedule, step_seconds=sum(terms.values()),
                      seconds=terms, ticks=ticks, sends=sends, temp_bytes=float(temp_bytes))
