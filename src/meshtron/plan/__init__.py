"""``meshtron plan``: the PTD-P paper's performance model, and a layout search built on it.

Narayanan et al. (SC21) give the counts -- parameters (eq. 2), FLOPs (eq. 3), bubble (§2.2),
communication per mesh axis (§3.2-3.3, §4.1) -- and heuristics for choosing a layout (§3's
takeaways), but no model of time. This package adds one, from a cluster's datasheet and a short
efficiency table (:mod:`.cluster`), so that a layout can be priced before any GPU is rented.
Beyond the paper's GPT with full recomputation it prices the Llama family (grouped-query attention,
SwiGLU, an untied head), selective recomputation with sequence parallelism (Korthikanti et al. 2022)
and the zero levels:

* :mod:`.model` -- what a layout costs independent of hardware: parameters, FLOPs, memory per GPU,
  bytes per mesh axis (calling :mod:`meshtron.megatron`, where the formulas are held against
  compiled programs, and the schedule tables of :mod:`meshtron.pipeline.schedules`);
* :mod:`.timing` -- seconds per step on a cluster, term by term, and TF/s per GPU the paper's way;
* :mod:`.search` -- every valid layout that fits, ranked;
* :mod:`.report` -- the table and the reasons, in the paper's terms;
* :mod:`.step_memory` -- meshtron's own step's memory per device (GPT, Llama, any contract model's
  parameters; zero levels, recomputation, sequence parallelism, every schedule), on a GPU and on XLA:CPU,
  which ``describe`` prints and ``plan`` shows beside Megatron-LM's.
The same model fed costs measured on the simulated CPU mesh -- the step time of meshtron's own runs
out -- is a benchmark harness, not part of the package: ``benchmarks/calibration.py``.

Pure Python and numpy: no JAX, no devices (``meshtron plan`` answers in about a second).
"""

from meshtron.plan.cluster import Cluster, bundled_clusters, load_cluster
from meshtron.plan.model import (
    GRADIENTS,
    Gradients,
    Layout,
    Memory,
    ModelShape,
    activation_bytes,
    data_wire_bytes,
    flops_per_iteration,
    in_flight_chunks,
    memory_per_gpu,
    parameter_count,
    pipe_wire_bytes,
    tensor_wire_bytes,
)
from meshtron.plan.report import Plan, make_plan, render
from meshtron.plan.search import SearchResult, search
from meshtron.plan.timing import Estimate, bubble_fraction, estimate

__all__ = [
    "GRADIENTS",
    "Cluster",
    "Estimate",
    "Gradients",
    "Layout",
    "Memory",
    "ModelShape",
    "Plan",
    "SearchResult",
    "activation_bytes",
    "bubble_fraction",
    "bundled_clusters",
    "data_wire_bytes",
    "estimate",
    "flops_per_iteration",
    "in_flight_chunks",
    "load_cluster",
    "make_plan",
    "memory_per_gpu",
    "parameter_count",
    "pipe_wire_bytes",
    "render",
    "search",
    "tensor_wire_bytes",
]
