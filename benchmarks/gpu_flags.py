"""What XLA:GPU's scheduling flags do to a compiled step: hidden fraction and estimated step time.

Compiles one training step for 8 H100s (compile-only, no GPU needed) once per flag setting -- each in
a fresh process, since XLA reads ``XLA_FLAGS`` once, when JAX starts -- and prices the scheduled
program with :func:`meshtron.gpu.step_time.estimate_step`. The step is Llama-2 7B's layer (hidden
4,096, SwiGLU 11,008, 32 heads; two layers, 2,048 tokens) on data 2 x tensor 4 with ZeRO-1 and
sequence parallelism, so the tensor axis carries the all-gathers before the column-parallel
projections and the reduce-scatters after the row-parallel ones that collective matmuls would hide.
One row turns on meshtron's own collective matmul instead of a flag (``parallel.collective_matmul``:
the blocks' projections gather and reduce-scatter the residual stream as rings of collective-permutes,
:mod:`meshtron.models.collective_matmul`). Two last rows compile the same step on the tensor axis
alone (data 1, 4 GPUs, half the batch), where XLA compiles windowed einsum. Prints a table and writes ``benchmarks/results/gpu_flags.json``; a
setting XLA crashes on is a row with the crash.

The flags (names checked against the CUDA plugin of jaxlib 0.12; ``strings xla_cuda_plugin.so``):

- ``--xla_gpu_enable_latency_hiding_scheduler`` (on by default): the scheduler that moves
  collective starts early and dones late around independent compute. Off, starts and dones sit
  next to each other and nothing is hidden.
- ``--xla_gpu_disable_async_collectives=ALLREDUCE,ALLGATHER,...``: named kinds stay synchronous.
- ``--xla_gpu_enable_pipelined_all_gather`` / ``_reduce_scatter`` / ``_all_reduce`` (off by
  default): the collective pipeliner moves a loop's collectives into the previous/next iteration,
  so a layer loop's all-gather can hide under the previous layer's compute.
- ``--xla_gpu_pipeline_all_gather`` / ``_reduce_scatter`` / ``_all_reduce``: strings of that name
  are in jaxlib 0.12's plugin, but its ``XLA_FLAGS`` parser rejects them (unknown flags): use the
  ``enable_pipelined_*`` spellings above.
- ``--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER`` (the older
  ``--xla_gpu_enable_while_loop_double_buffering``): unrolls loops by two so the scheduler can
  overlap across iterations.
- ``--xla_gpu_all_reduce_combine_threshold_bytes`` (and ``all_gather``/``reduce_scatter``): how
  large combined collectives may grow; fewer, larger collectives pay less latency but have less
  compute to hide under.
- ``--xla_gpu_experimental_parallel_collective_overlap_limit``: collectives in flight at once
  (the estimate runs them one at a time either way).
- ``--xla_gpu_threshold_for_windowed_einsum_mib=0`` (default 100000: off): the SPMD partitioner
  turns a dot whose sharded operand is at least this many MiB into a *windowed einsum* loop -- an
  all-gather+dot becomes a loop of collective-permutes each feeding one slice's dot, a
  dot+reduce-scatter a loop passing partial sums around the ring -- and XLA:GPU's windowed-einsum
  handler unrolls those loops. It acts only where the partitioner itself inserts
  the collective for a dot: an all-gather a sharding constraint asks for before the dot (meshtron's
  ``enter_parallel_region``) stays an all-gather.
- ``--xla_gpu_multi_streamed_windowed_einsum=true``: asks the handler to put the loops' GEMMs on
  their own compute streams (``fusion-start``/``fusion-done`` with an ``operation_queue_id``); in
  jaxlib 0.12 its unrolled loops get them without the flag too.
- ``--xla_disable_hlo_passes=windowed-einsum-handler``: the partitioner's loops without the GPU
  handler (not unrolled, GEMMs on the compute stream).

Usage: ``python benchmarks/gpu_flags.py`` (about a minute per setting on an idle machine; the
``gpu-compile`` extra).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter

CONFIG = "llama2_7b"
OVERRIDES = ["model.layers=2", "model.seq_len=2048", "model.attention=cudnn", "model.remat=selective",
             "parallel.data=2", "parallel.pipe=1", "parallel.tensor=4", "parallel.zero=1",
             "parallel.sequence_parallel=true", "parallel.microbatches=1", "train.batch_size=4"]
TARGET = "h100"
ALL_KINDS = "ALLREDUCE,ALLGATHER,REDUCESCATTER,COLLECTIVEPERMUTE,ALLTOALL"
WINDOWED = "--xla_gpu_threshold_for_windowed_einsum_mib=0"
# The same step on the tensor axis alone (4 GPUs, half the batch): XLA compiles windowed einsum there.
TENSOR_ALONE = ["parallel.data=1", "train.batch_size=2"]
SETTINGS = [
    ("defaults", ""),
    ("no latency-hiding scheduler", "--xla_gpu_enable_latency_hiding_scheduler=false"),
    ("synchronous collectives", f"--xla_gpu_disable_async_collectives={ALL_KINDS}"),
    ("pipelined AG+RS+AR", ("--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true "
                           "--xla_gpu_enable_pipelined_all_reduce=true")),
    ("loops unrolled by 2", "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER"),
    ("combine up to 256 MiB", ("--xla_gpu_all_reduce_combine_threshold_bytes=268435456 "
                              "--xla_gpu_all_gather_combine_threshold_bytes=268435456 "
                              "--xla_gpu_reduce_scatter_combine_threshold_bytes=268435456")),
    ("2 collectives in flight", "--xla_gpu_experimental_parallel_collective_overlap_limit=2"),
    ("windowed einsum", WINDOWED),
    ("windowed einsum, multi-streamed GEMMs", f"{WINDOWED} --xla_gpu_multi_streamed_windowed_einsum=true"),
    ("windowed loops, no GPU handler", f"{WINDOWED} --xla_disable_hlo_passes=windowed-einsum-handler"),
    ("collective matmul (parallel.collective_matmul)", "", ["parallel.collective_matmul=true"]),
    ("tensor 4 alone: defaults", "", TENSOR_ALONE),
    ("tensor 4 alone: windowed einsum, multi-streamed", f"{WINDOWED} --xla_gpu_multi_streamed_windowed_einsum=true",
     TENSOR_ALONE),
]


def _one(extra: list[str]) -> dict:
    """Child process: compile with this process's XLA_FLAGS (and ``extra`` overrides) and estimate the step."""
    from meshtron.gpu.targets import prepare_environment

    prepare_environment()
    import jax

    from meshtron.config import load_config
    from meshtron.gpu.step_time import estimate_json, estimate_step, model_flops
    from meshtron.hlo.schedule import collective_windows
    from meshtron.train.loop import Trainer

    cfg = load_config(CONFIG, [*OVERRIDES, *extra])
    start = time.perf_counter()
    trainer = Trainer.from_config(cfg, target=TARGET, read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    text = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0]).as_text()
    compile_s = time.perf_counter() - start
    sizes = dict(trainer.mesh.shape)
    m = cfg.model
    step_tokens = cfg.train.batch_size * m.seq_len
    n_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    total, attention = model_flops(params=n_params, layers=m.layers, hidden=m.hidden,
                                   seq_len=m.seq_len, tokens=step_tokens)
    estimate = estimate_step(text, sizes, TARGET, tokens_per_step=step_tokens, model_flops_per_step=total,
                             causal_attention_flops_per_step=attention)
    windows = collective_windows(text, sizes)
    tensor = [w for w in windows if "tensor" in w.collective.axes]
    return {"compile_s": round(compile_s, 1), "async": sum(not w.synchronous for w in windows),
            "sync": sum(w.synchronous for w in windows),
            "tensor_collectives": dict(Counter(f"{w.kind} {'sync' if w.synchronous else 'async'}" for w in tensor)),
            "estimate": estimate_json(estimate)}


def main() -> None:
    if "--one" in sys.argv:
        print("RESULT " + json.dumps(_one(sys.argv[sys.argv.index("--one") + 1 :])))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import child_failure, print_table, write_results

    runs = []
    for label, flags, *extra in SETTINGS:
        extra = extra[0] if extra else []
        env = {**os.environ, "XLA_FLAGS": " ".join(f for f in ("--xla_force_host_platform_device_count=8", flags) if f)}
        done = subprocess.run([sys.executable, __file__, "--one", *extra], check=False, env=env, capture_output=True,
                              text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            runs.append({"setting": label, "flags": flags, "overrides": extra, "error": child_failure(done)})
        else:
            runs.append({"setting": label, "flags": flags, "overrides": extra, **json.loads(line[len("RESULT "):])})
        print(f"{label}: done", file=sys.stderr, flush=True)
    rows = []
    for run in runs:
        if "error" in run:
            rows.append([run["setting"], run["error"][:70], "", "", "", "", "", ""])
            continue
        e = run["estimate"]
        rows.append([run["setting"], f"{e['seconds'] * 1e3:.3f}", f"{e['communication_seconds'] * 1e3:.3f}",
                     f"{e['exposed_communication_seconds'] * 1e3:.3f}",
                     f"{max(0.0, 1 - e['exposed_communication_seconds'] / max(e['communication_seconds'], 1e-30)):.1%}",
                     f"{e['hidden_fraction_by_axes'].get('tensor', 1.0):.1%}", f"{run['async']}/{run['sync']}",
                     f"{e['mfu']:.1%}"])
    print(f"{CONFIG} {' '.join(OVERRIDES)} on 8 x {TARGET}, gemm_efficiency {runs[0].get('estimate', {}).get('gemm_efficiency')}")
    print_table(["setting", "step ms", "collectives ms", "exposed ms", "hidden", "tensor hidden", "async/sync", "MFU"],
                rows)
    path = write_results("gpu_flags", {"config": CONFIG, "overrides": OVERRIDES, "target": TARGET, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
