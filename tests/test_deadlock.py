"""The pipeline runtime cannot deadlock: a proof on the compiled program, and a stress test.

* The proof: in the optimized HLO of every pipelined train step, every operation that runs
  collectives inside a nested computation (the per-device stage ``cond``-s) is ordered by data
  dependencies against every other collective-bearing operation (see
  :mod:`meshtron.hlo.order`). The checker itself is tested on hand-written HLO, its rule for a
  runtime that executes the schedule (XLA:GPU: a send in flight across a stage's ``cond``) too.
* The stress test: real training runs over many (mesh, schedule, microbatches, vocabulary, hidden,
  batch) combinations -- the 1F1B run that used to deadlock on jaxlib 0.10.2 among them -- each in
  its own process under a time limit; a hang, an XLA abort or any non-zero exit fails. The train
  step each run compiled passes the proof too, so the proof compiles in this process only the
  layouts no stress run has.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from meshtron.config import MeshConfig, ModelConfig, TrainConfig
from meshtron.execution import Execution
from meshtron.hlo.order import unordered_collectives
from meshtron.mesh import build_mesh
from meshtron.optim import build_optimizer, data_parallel_mean
from meshtron.pipeline.execution import PipelinePlan
from meshtron.pipeline.schedules import compile_program, make_schedule
from meshtron.train.pipelined import to_stage_order
from meshtron.train.state import model_def_from_config
from meshtron.train.step import build_steps

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]

ROOT = Path(__file__).resolve().parents[1]

# The branches of the hand-written modules below: one all-reduces over GROUPS, the other does nothing.
_BRANCHES = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%work (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  ROOT %ar = f32[4] all-reduce(f32[4] %p), channel_id=2, replica_groups=GROUPS, to_apply=%add
}

%idle (q: f32[4]) -> f32[4] {
  ROOT %q = f32[4] parameter(0)
}
"""

# A conditional whose branch all-reduces, next to a collective-permute: unordered unless the
# permute reads the conditional's result.
_HLO = """HloModule m

""" + _BRANCHES.replace("GROUPS", "{{0,1}}") + """
ENTRY %main (x: f32[4], pred: pred[]) -> (f32[4], f32[4]) {
  %x = f32[4] parameter(0)
  %pred = pred[] parameter(1)
  %cond = f32[4] conditional(pred[] %pred, f32[4] %x, f32[4] %x), true_computation=%work, false_computation=%idle
  %send = f32[4] collective-permute(f32[4] %SOURCE), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %out = (f32[4], f32[4]) tuple(f32[4] %cond, f32[4] %send)
}
"""


def test_checker_finds_a_conditional_racing_a_collective():
    [pair] = unordered_collectives(_HLO.replace("%SOURCE", "%x"))
    assert (pair.computation, {pair.first, pair.second}) == ("main", {"cond", "send"})


def test_checker_accepts_a_data_dependency():
    assert unordered_collectives(_HLO.replace("%SOURCE", "%cond")) == []


def test_checker_accepts_control_predecessors():
    text = _HLO.replace("%SOURCE", "%x").replace(
        "source_target_pairs={{0,1},{1,0}}", "source_target_pairs={{0,1},{1,0}}, control-predecessors={%cond}")
    assert unordered_collectives(text) == []


# A scheduled module as XLA:GPU runs it: a collective-permute in flight (start ... done) across a
# conditional whose branch all-reduces over GROUPS. No data orders the two, the schedule does.
_SCHEDULED_HLO = """HloModule m, is_scheduled=true, num_partitions=4

""" + _BRANCHES + """
ENTRY %main (x: f32[4], pred: pred[]) -> (f32[4], f32[4]) {
  %x = f32[4] parameter(0)
  %pred = pred[] parameter(1)
  %start = (f32[4], f32[4]) collective-permute-start(f32[4] %x), channel_id=1, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  %cond = f32[4] conditional(pred[] %pred, f32[4] %x, f32[4] %x), true_computation=%work, false_computation=%idle
  %done = f32[4] collective-permute-done((f32[4], f32[4]) %start)
  ROOT %out = (f32[4], f32[4]) tuple(f32[4] %cond, f32[4] %done)
}
"""


def test_schedule_order_proves_a_send_in_flight_across_a_stage_conditional():
    # the permute's pairs cross stages ({0,1} and {2,3} here), the branch's all-reduce stays in one
    stage_groups = _SCHEDULED_HLO.replace("GROUPS", "{{0,1},{2,3}}")
    assert [(p.first, p.second) for p in unordered_collectives(stage_groups)] == [("cond", "start")]
    assert unordered_collectives(stage_groups, in_schedule_order=True) == []


def test_schedule_order_rejects_a_collective_under_one_in_flight_that_shares_two_devices():
    [pair] = unordered_collectives(_SCHEDULED_HLO.replace("GROUPS", "{{0,2},{1,3}}"), in_schedule_order=True)
    assert (pair.computation, pair.first, pair.second, pair.shared_devices) == ("main", "start", "cond", 2)
    assert "sharing 2 devices" in str(pair)


def test_schedule_order_needs_a_scheduled_module():
    with pytest.raises(ValueError, match="in_schedule_order needs a scheduled module"):
        unordered_collectives(_SCHEDULED_HLO.replace(", is_scheduled=true", ""), in_schedule_order=True)


MODEL = ModelConfig(vocab_size=256, hidden=32, heads=4, layers=8, mlp_dim=64, seq_len=16)

# (data, pipe, tensor), schedule, chunks, microbatches: every schedule, tensor inside a stage or not. These are
# the layouts no stress run below has: each stress run's own compiled train step is proved too (1F1B on
# (2,2,2) and (1,4,2), interleaved on (2,2,2) and (2,4,1), GPipe, 1F1B-p, 1-bit LAMB's step). CI runs one
# stress run (1F1B on (2,2,2), the run that deadlocked), so GPipe's and 1F1B-p's steps are proved here too;
# interleaved's is proved below (every mesh config's default schedule is interleaved).
LAYOUTS = [
    ((1, 2, 4), "1f1b", 1, 4),
    ((2, 2, 2), "zb-h1", 1, 4),  # a third kind of work (W) in its own conditional
    ((2, 2, 2), "zb-h1", 1, 4, False),  # the forward keeps residuals for B (parallel.recompute=false)
    ((2, 2, 2), "gpipe", 1, 2),
    ((2, 2, 2), "1f1b-p", 1, 4),  # each backward's rerun hoisted into the forward tick before
]
# Further cases: CI proves 1F1B's step by the stress run it keeps (1F1B on (2,2,2)), zb-h1's W conditional
# below (with the gathered context), and keeping residuals below (interleaved, with the Mixtral's all-to-alls
# and with sequence parallelism).
_EXTENDED_LAYOUTS = (((1, 2, 4), "1f1b", 1, 4), ((2, 2, 2), "zb-h1", 1, 4), ((2, 2, 2), "zb-h1", 1, 4, False))
_LAYOUT_CASES = [pytest.param(*(*layout, True)[:5], marks=pytest.mark.extended if layout in _EXTENDED_LAYOUTS else ())
                 for layout in LAYOUTS]


def assert_orders_every_collective(hlo) -> None:
    """``hlo`` (a compiled pipelined train step, or its optimized HLO text) skips idle slots in conditionals
    and orders every collective by data dependencies."""
    text = hlo if isinstance(hlo, str) else hlo.as_text()
    assert "conditional" in text, "idle slots must still be skipped"
    assert unordered_collectives(hlo) == []


@pytest.mark.parametrize("mesh_shape, schedule, chunks, microbatches, recompute", _LAYOUT_CASES)
def test_compiled_pipelined_step_orders_every_collective(mesh_shape, schedule, chunks, microbatches, recompute):
    md = model_def_from_config(MODEL, mesh_shape[2])
    mesh = build_mesh(MeshConfig(*mesh_shape), jax.devices()[: int(np.prod(mesh_shape))])
    program = compile_program(make_schedule(schedule, mesh_shape[1], microbatches, chunks),
                              keep_residuals=not recompute)
    steps = build_steps(md, mesh, data_parallel_mean(), build_optimizer(TrainConfig(), md.logical_axes()), microbatches=microbatches,
                        pipeline=PipelinePlan(program), execution=Execution.of_model_config(MODEL))
    params = jax.device_put(to_stage_order(jax.device_get(md.init(mesh, 0)), MODEL.layers, mesh_shape[1], chunks),
                            steps.param_shardings)
    batch = jax.device_put(np.zeros((mesh_shape[0] * microbatches, MODEL.seq_len + 1), np.int32), steps.batch_sharding)
    assert_orders_every_collective(steps.lower(params, steps.init_opt_state(params), batch).compile())


# A mixture of experts adds all-to-alls over `data` inside the stage `cond`-s (context parallelism,
# all-gathers over `context`); full recomputation reruns
# each layer, with them, in the backward pass; sequence parallelism splits the activations the runtime
# takes its ordering tokens from, and makes the norms' gradients all-reduces nothing downstream reads.
# One proof per pattern of collectives: full recomputation (kept residuals or not) is proved on the Mixtral,
# whose step holds the Llama's attention and tensor all-reduces with the experts' all-to-alls beside them.
MOE_LAYOUTS = [
    ("mixtral_cpu8", ["model.remat=full"]),
    ("mixtral_cpu8", ["model.remat=full", "parallel.recompute=false"]),
    ("mixtral_cpu8", ["parallel.schedule=zb-h1", "parallel.chunks=1", "model.moe.capacity_factor=1.0"]),
    ("mixtral_cpu8", ["parallel.sequence_parallel=true", "model.remat=full"]),
    ("llama_cpu8", ["parallel.sequence_parallel=true"]),
    ("llama_cpu8", ["parallel.sequence_parallel=true", "parallel.recompute=false"]),
    ("cpu8", ["parallel.sequence_parallel=true", "parallel.schedule=zb-h1", "parallel.chunks=1"]),
    # context parallelism: keys and values all-gathered over `context` inside the stage `cond`-s (and the
    # ring's collective-permutes without a pipeline), with recomputation and sequence parallelism
    ("llama_cpu8", ["parallel.data=1", "parallel.context=2", "model.remat=full"]),
    ("llama_cpu8", ["parallel.data=1", "parallel.context=2", "parallel.schedule=zb-h1", "parallel.chunks=1"]),
    ("cpu8", ["parallel.data=1", "parallel.context=2", "parallel.sequence_parallel=true"]),
    ("llama_cpu8", ["parallel.pipe=1", "parallel.context=2", "parallel.context_attention=ring", "model.remat=selective"]),
    ("llama_cpu8", ["parallel.data=1", "parallel.context=2", "parallel.context_attention=ring"]),  # stages in lockstep
    # 1f1b-p reruns a backward's stage forward in the tick before, in a conditional of its own
    ("mixtral_cpu8", ["parallel.schedule=1f1b-p", "parallel.chunks=1", "model.remat=full"]),
    ("llama_cpu8", ["parallel.sequence_parallel=true", "parallel.schedule=1f1b-p", "parallel.chunks=1"]),
    ("llama_cpu8", ["parallel.data=1", "parallel.context=2", "parallel.context_attention=ring",
                    "parallel.schedule=1f1b-p", "parallel.chunks=1"]),
    # Ulysses: all-to-alls over `context` inside the stage `cond`-s; the hybrid's with its ring, in lockstep
    ("llama_cpu8", ["parallel.data=1", "parallel.context=2", "parallel.context_attention=ulysses"]),
    ("llama_cpu8", ["parallel.data=1", "parallel.tensor=1", "parallel.context=4", "parallel.context_attention=hybrid",
                    "parallel.ulysses_degree=2"]),
]
# The second stack checks two; the rest run on the first.
_BOTH_STACKS = [
    ("mixtral_cpu8", ["parallel.sequence_parallel=true", "model.remat=full"]),
    ("llama_cpu8", ["parallel.sequence_parallel=true", "parallel.recompute=false"]),
    ("llama_cpu8", ["parallel.data=1", "parallel.context=2", "parallel.schedule=zb-h1", "parallel.chunks=1"]),
]
# Further cases of a pattern CI proves on another layout: CI keeps the Mixtral's all-to-alls under full
# recomputation (with sequence parallelism; and keeping residuals), sequence parallelism (keeping residuals),
# the gathered context (zb-h1; sequence parallelism), the ring (without a pipeline; stages in lockstep),
# Ulysses and the hybrid; 1F1B-p's hoisted reruns are proved above.
_EXTENDED_MOE = [
    ("mixtral_cpu8", ["model.remat=full"]),
    ("mixtral_cpu8", ["parallel.schedule=zb-h1", "parallel.chunks=1", "model.moe.capacity_factor=1.0"]),
    ("llama_cpu8", ["parallel.sequence_parallel=true"]),
    ("cpu8", ["parallel.sequence_parallel=true", "parallel.schedule=zb-h1", "parallel.chunks=1"]),
    ("llama_cpu8", ["parallel.data=1", "parallel.context=2", "model.remat=full"]),
    ("mixtral_cpu8", ["parallel.schedule=1f1b-p", "parallel.chunks=1", "model.remat=full"]),
    ("llama_cpu8", ["parallel.sequence_parallel=true", "parallel.schedule=1f1b-p", "parallel.chunks=1"]),
    ("llama_cpu8", ["parallel.data=1", "parallel.context=2", "parallel.context_attention=ring",
                    "parallel.schedule=1f1b-p", "parallel.chunks=1"]),
]
_MOE_CASES = [pytest.param(c, o, id=f"{c} {' '.join(o)}",
                           marks=(() if (c, o) in _BOTH_STACKS else (pytest.mark.first_stack_only,))
                           + ((pytest.mark.extended,) if (c, o) in _EXTENDED_MOE else ()))
              for c, o in MOE_LAYOUTS]


@pytest.mark.parametrize("config, overrides", _MOE_CASES)
def test_expert_parallel_recomputed_and_sequence_parallel_steps_order_every_collective(config, overrides):
    from meshtron.config import load_config
    from meshtron.train.loop import Trainer

    small = ["model.hidden=64", "model.mlp_dim=128", "model.seq_len=32", "train.batch_size=8"]
    moe = ["model.moe.mlp_dim=32"] if "mixtral" in config else []
    cfg = load_config(config, [*small, *overrides, *moe, *(["model.heads=4"] if config == "cpu8" else [])])
    trainer = Trainer.from_config(cfg)
    # the step's arguments as abstract arrays laid out as a run lays them out: the same program as for arrays
    # (nothing is run, so no model is initialised)
    params, opt_state, batch = trainer.abstract_step_arguments()
    compiled = trainer.steps.lower(params, opt_state, batch).compile()
    ulysses = any(o.endswith(("=ulysses", "=hybrid")) for o in overrides)
    assert ("all-to-all" in compiled.as_text()) == ("mixtral" in config or ulysses)
    assert unordered_collectives(compiled) == []
    if "mixtral" in config:  # the forward-only pipeline that measures the routing on logged steps
        assert unordered_collectives(trainer.steps.lower_reports(params, batch).compile()) == []


# Each entry: overrides of mesh_configs/cpu8.yaml for one run. The first is the 1F1B run that
# deadlocked on jaxlib 0.10.2 (devices 6 and 7 split between an all-reduce and a ppermute).
STRESS = {
    "1f1b-2x2x2-wide": ["model.layers=4", "model.hidden=256", "model.heads=4", "model.mlp_dim=1024",
                           "model.seq_len=128", "model.vocab_size=1024", "train.batch_size=8", "parallel.data=2",
                           "parallel.pipe=2", "parallel.tensor=2", "parallel.microbatches=4", "parallel.schedule=1f1b",
                           "parallel.chunks=1"],
    "interleaved-2x2x2-m4": ["model.hidden=64", "model.mlp_dim=128", "model.vocab_size=512", "train.batch_size=16",
                             "parallel.microbatches=4", "parallel.schedule=interleaved", "parallel.chunks=2"],
    "gpipe-2x2x2-m2": ["model.hidden=96", "model.heads=6", "model.mlp_dim=192", "model.seq_len=32",
                       "train.batch_size=8", "parallel.microbatches=2", "parallel.schedule=gpipe", "parallel.chunks=1"],
    "1f1b-1x4x2-m8": ["parallel.data=1", "parallel.pipe=4", "parallel.tensor=2", "model.hidden=64", "model.mlp_dim=128",
                      "model.seq_len=32", "train.batch_size=16", "parallel.microbatches=8", "parallel.schedule=1f1b",
                      "parallel.chunks=1"],
    "interleaved-2x4x1-m4": ["parallel.data=2", "parallel.pipe=4", "parallel.tensor=1", "model.layers=8", "model.hidden=64",
                             "model.mlp_dim=128", "model.seq_len=32", "model.vocab_size=384", "train.batch_size=8",
                             "parallel.microbatches=4", "parallel.schedule=interleaved", "parallel.chunks=2"],
    "1f1b-p-1x4x2-m8": ["parallel.data=1", "parallel.pipe=4", "parallel.tensor=2", "model.hidden=64",
                        "model.mlp_dim=128", "model.seq_len=32", "train.batch_size=16", "parallel.microbatches=8",
                        "parallel.schedule=1f1b-p", "parallel.chunks=1"],
    "1f1b-2x2x2-onebit": ["model.hidden=64", "model.mlp_dim=128", "model.seq_len=32", "train.batch_size=8",
                          "parallel.microbatches=2", "parallel.schedule=1f1b", "parallel.chunks=1",
                          "train.optimizer=onebit_lamb", "optim.freeze_step=1"],
}
STRESS_TIMEOUT_S = 420  # per run; XLA's own rendezvous timeout aborts a stuck collective after 40 s


# The second stack runs each schedule (and 1-bit LAMB) once: 1F1B-p's run has 1F1B's other mesh, (1,4,2).
_STRESS_FIRST_STACK_ONLY = ("1f1b-1x4x2-m8", "interleaved-2x4x1-m4")


# CI runs two: the 1F1B run that deadlocked on jaxlib 0.10.2, and 1-bit LAMB's (its compressed exchange is
# proved nowhere else). The rest are ``extended`` (their schedules' steps are proved in CI above).
_STRESS_IN_CI = ("1f1b-2x2x2-wide", "1f1b-2x2x2-onebit")


def _stress_marks(name: str) -> tuple:
    return (((pytest.mark.first_stack_only,) if name in _STRESS_FIRST_STACK_ONLY else ())
            + (() if name in _STRESS_IN_CI else (pytest.mark.extended,)))


@pytest.mark.parametrize("name", [pytest.param(name, marks=_stress_marks(name)) for name in STRESS])
def test_stress_run_finishes(name, tmp_path):
    """The run exits, and the train step it compiled (XLA writes its optimized HLO out; a compilation cache of
    the run's own, so the step is compiled here) passes the proof."""
    args = [sys.executable, "-m", "meshtron.cli", "train", "--config", str(ROOT / "mesh_configs" / "cpu8.yaml"),
            *STRESS[name], "train.steps=4", "train.eval_every=100", "train.eval_batches=2", "train.log_every=1", "model.dtype=float32"]
    dump = tmp_path / "hlo"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text "
                        "--xla_dump_hlo_module_re=jit_train"}
    try:
        done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=STRESS_TIMEOUT_S, check=False,
                              env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{name}: no exit after {STRESS_TIMEOUT_S} s (a hang)\n{(err.stderr or b'')[-3000:]!r}")
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}"
    assert "held-out loss" in done.stdout + done.stderr
    steps = sorted(dump.glob("*.jit_train.cpu_after_optimizations.txt"))
    assert steps, f"{name}: no compiled train step written to {dump}"
    for step in steps:
        assert_orders_every_collective(step.read_text())
