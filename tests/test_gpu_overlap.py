"""``gpu.overlap`` and ``gpu.xla_flags``: parsed into typed XLA compiler options, checked as config
fields, handed to every program of a run, the same losses on the CPU either way; on GPUs the pipeline's
early sends (the same step as the chained order, checked on the CPU); compiled for 8 H100s, every pipeline
schedule with ``gpu.overlap=on``, the backward's GEMMs under the pipe sends, and more of the pipe
communication hidden than with an expert's pipelined p2p. Also the schedule of a
collective-permute XLA:GPU decomposed into send/recv pairs (pipelined p2p), and the trip count of a
loop XLA recorded none for."""

from __future__ import annotations

import json

import pytest

from meshtron.config import load_config
from meshtron.errors import ConfigError
from meshtron.gpu.step_time import estimate_step
from meshtron.hlo.collectives import collectives
from meshtron.hlo.schedule import collective_windows
from meshtron.xla_options import (
    OVERLAP_ON,
    as_flags,
    compiler_options,
    for_this_xla,
    parse_xla_flags,
    run_options,
)

TINY = ["model.layers=4", "model.hidden=32", "model.heads=4", "model.mlp_dim=64", "model.seq_len=16",
        "model.vocab_size=256", "train.batch_size=8", "train.warmup_steps=1", "train.eval_every=1000",
        "train.eval_batches=1", "train.log_every=1", "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
        "parallel.schedule=1f1b", "parallel.microbatches=2", "parallel.zero=1"]


def test_xla_flags_parse_into_typed_options():
    options = parse_xla_flags("--xla_gpu_enable_pipelined_p2p=true --xla_gpu_collective_permute_decomposer_threshold=0 "
                              "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER "
                              "--xla_gpu_memory_limit_slop_factor=95.5 --xla_gpu_enable_latency_hiding_scheduler")
    assert options == {"xla_gpu_enable_pipelined_p2p": True, "xla_gpu_collective_permute_decomposer_threshold": 0,
                       "xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_DOUBLE_BUFFER",
                       "xla_gpu_memory_limit_slop_factor": 95.5, "xla_gpu_enable_latency_hiding_scheduler": True}
    assert parse_xla_flags(as_flags(OVERLAP_ON)) == OVERLAP_ON


def test_xla_flags_spellings_of_the_collective_pipeliner_become_its_fields():
    # XLA_FLAGS takes the old boolean spellings and short modes; a compiler option must name the enum field
    assert parse_xla_flags("--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_pipeline_reduce_scatter=on "
                           "--xla_gpu_enable_pipelined_all_reduce=false") == {
        "xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_ON",
        "xla_gpu_pipeline_reduce_scatter": "COLLECTIVE_PIPELINING_MODE_ON",
        "xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_DEFAULT"}


def test_overlap_on_is_the_bundle_and_an_experts_flag_wins():
    assert compiler_options("off", None) == {}
    assert compiler_options("on", None) == OVERLAP_ON
    mine = compiler_options("on", "--xla_gpu_enable_pipelined_all_gather=false --xla_gpu_enable_pipelined_p2p=true")
    assert mine["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_DEFAULT"
    assert mine["xla_gpu_enable_pipelined_p2p"] is True


@pytest.mark.parametrize(("override", "message"), [
    ("gpu.overlap=maybe", r"^gpu\.overlap: must be one of off, on, got 'maybe'$"),
    ("gpu.xla_flags=xla_gpu_enable_pipelined_p2p=true", r"^gpu\.xla_flags: 'xla_gpu_enable_pipelined_p2p=true' is not an XLA flag"),
    ("gpu.xla_flags=--xla_gpu_enable_pipelined_p2p=", r"^gpu\.xla_flags: '--xla_gpu_enable_pipelined_p2p=' is not"),
    ("gpu.xla_flags=--Bad-Name=1", r"^gpu\.xla_flags: '--Bad-Name=1' is not an XLA flag"),
])
def test_a_bad_gpu_field_is_one_line_naming_it(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [override])
    assert "\n" not in str(err.value)


def test_on_and_off_read_as_yaml_writes_them(tmp_path):
    # YAML 1.1 reads an unquoted on/off as a boolean: the field still says on/off.
    assert load_config(None, ["gpu.overlap=on"]).gpu.overlap == "on"
    assert load_config(None, ["gpu.overlap=off"]).gpu.overlap == "off"
    path = tmp_path / "c.yaml"
    path.write_text("gpu:\n  overlap: on\n  xla_flags: --xla_gpu_enable_pipelined_p2p=true\n")
    cfg = load_config(path)
    assert (cfg.gpu.overlap, cfg.gpu.xla_flags) == ("on", "--xla_gpu_enable_pipelined_p2p=true")


def test_options_take_this_xlas_spelling_and_an_unknown_one_is_a_config_error():
    import jax

    # jaxlib 0.12's XLA has the enum field, older ones the boolean flag: either way the switch is on
    (name, value), = run_options("off", "--xla_gpu_pipeline_all_gather=on").items()
    assert (name, value) in {("xla_gpu_pipeline_all_gather", "COLLECTIVE_PIPELINING_MODE_ON"),
                             ("xla_gpu_enable_pipelined_all_gather", True)}
    assert run_options("off", "--xla_gpu_enable_pipelined_all_gather=true") == {name: value}
    with pytest.raises(ConfigError, match=rf"^gpu\.xla_flags: the XLA of jax {jax.__version__} has no option "
                                          r"xla_gpu_no_such_option=1; check the name"):
        run_options("off", "--xla_gpu_no_such_option=1")


def _losses(tmp_path, name: str, *overrides: str) -> list[float]:
    from meshtron.train.loop import Trainer

    trainer = Trainer.from_config(load_config(None, [*TINY, "train.steps=3", *overrides]))
    path = tmp_path / f"{name}.jsonl"
    with open(path, "a+") as f:
        trainer.run(metrics_file=f)
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_overlap_on_and_off_give_the_same_losses_on_the_cpu(tmp_path):
    off = _losses(tmp_path, "off")
    on = _losses(tmp_path, "on", "gpu.overlap=on",
                 "gpu.xla_flags=--xla_gpu_enable_pipelined_p2p=true --xla_gpu_collective_permute_decomposer_threshold=0")
    assert len(off) == 3 and on == off


def test_sends_go_early_only_on_gpus_with_overlap_on():
    from meshtron.run import resolve_run

    runs = {overlap: resolve_run(load_config(None, [*TINY, f"gpu.overlap={overlap}"]), 8) for overlap in ("off", "on")}
    assert runs["on"].pipeline_on("gpu").early_sends
    assert not runs["on"].pipeline_on("cpu").early_sends
    assert not runs["off"].pipeline_on("gpu").early_sends
    assert runs["on"].pipeline_on("gpu").program is runs["on"].pipeline.program


@pytest.mark.slow
@pytest.mark.fusion_emitters  # two programs' outputs, bit for bit
@pytest.mark.parametrize(("mesh_shape", "schedule", "chunks", "microbatches"), [
    pytest.param((1, 4, 1), "1f1b", 1, 8, marks=pytest.mark.extended, id="mesh_shape0-1f1b-1-8"),
    pytest.param((2, 2, 1), "zb-h1", 1, 4, id="mesh_shape1-zb-h1-1-4"),  # a segment that sends no input gradient after one that does
    pytest.param((2, 2, 1), "interleaved", 2, 4, marks=pytest.mark.extended, id="mesh_shape2-interleaved-2-4"),
])
def test_early_sends_compute_the_chained_step(mesh_shape, schedule, chunks, microbatches):
    """The early sends move the same messages between the same slots: the step's outputs are bit for bit
    those of the chained order. Run on the CPU with one tensor rank, so no stage ``cond`` holds a collective
    that XLA:CPU's runtime could start concurrently with a send."""
    import jax
    import numpy as np

    from meshtron.config import MeshConfig, ModelConfig, TrainConfig
    from meshtron.execution import Execution
    from meshtron.mesh import build_mesh
    from meshtron.optim import build_optimizer, data_parallel_mean
    from meshtron.pipeline.execution import PipelinePlan
    from meshtron.pipeline.schedules import compile_program, make_schedule
    from meshtron.train.pipelined import to_stage_order
    from meshtron.train.state import model_def_from_config
    from meshtron.train.step import build_steps

    model = ModelConfig(vocab_size=256, hidden=32, heads=4, layers=8, mlp_dim=64, seq_len=16)
    md = model_def_from_config(model, mesh_shape[2])
    mesh = build_mesh(MeshConfig(*mesh_shape), jax.devices()[: int(np.prod(mesh_shape))])
    program = compile_program(make_schedule(schedule, mesh_shape[1], microbatches, chunks))
    tokens = np.random.default_rng(0).integers(0, 256, (mesh_shape[0] * microbatches, model.seq_len + 1))
    outputs = []
    for early in (False, True):
        steps = build_steps(md, mesh, data_parallel_mean(), build_optimizer(TrainConfig(), md.logical_axes()),
                            microbatches=microbatches, pipeline=PipelinePlan(program, early_sends=early),
                            execution=Execution.of_model_config(model))
        params = jax.device_put(to_stage_order(jax.device_get(md.init(mesh, 0)), model.layers, mesh_shape[1], chunks),
                                steps.param_shardings)
        batch = jax.device_put(tokens.astype(np.int32), steps.batch_sharding)
        opt_state = steps.init_opt_state(params)
        outputs.append(jax.device_get(steps.lower(params, opt_state, batch).compile()(params, opt_state, batch)))
    chained, early_sent = (jax.tree.leaves(o) for o in outputs)
    assert len(chained) == len(early_sent) > 2
    for a, b in zip(chained, early_sent, strict=True):
        np.testing.assert_array_equal(a, b)


def test_every_program_of_the_run_gets_the_options():
    from meshtron.train.loop import Trainer

    trainer = Trainer.from_config(load_config(None, [*TINY, "gpu.overlap=on",
                                                     "gpu.xla_flags=--xla_gpu_enable_pipelined_p2p=true"]))
    assert trainer.steps.compiler_options == for_this_xla({**OVERLAP_ON, "xla_gpu_enable_pipelined_p2p": True})
    for program in (trainer.steps._train_jit, trainer.steps._eval_jit, trainer.steps._gradients_jit,
                    trainer.steps._init_jit):
        # what jax.jit hands XLA with each compile of the program
        assert dict(program._jit_info.compiler_options_kvs) == trainer.steps.compiler_options


# A collective-permute of a 4-stage ring (pipe 4) as XLA:GPU's pipelined p2p writes it: the decomposer
# splits the cycle into forward pairs and the back edge, two sends of the same data; a GEMM between the
# first send and its done hides it.
_SEND_RECV = """HloModule jit_step, is_scheduled=true

ENTRY %main (a: bf16[4096,4096], x: bf16[2048,4096]) -> (bf16[4096,4096], bf16[2048,4096]) {
  %a = bf16[4096,4096]{1,0} parameter(0)
  %x = bf16[2048,4096]{1,0} parameter(1)
  %after-all = token[] after-all()
  %fwd-recv = (bf16[2048,4096]{1,0}, u32[], token[]) recv(%after-all), channel_id=2, frontend_attributes={_xla_send_recv_source_target_pairs={{0,1},{1,2},{2,3}}}
  %fwd-send = (bf16[2048,4096]{1,0}, u32[], token[]) send(%x, %after-all), channel_id=2, frontend_attributes={_xla_send_recv_source_target_pairs={{0,1},{1,2},{2,3}}}
  %bwd-recv = (bf16[2048,4096]{1,0}, u32[], token[]) recv(%after-all), channel_id=1, frontend_attributes={_xla_send_recv_source_target_pairs={{3,0}}}
  %bwd-send = (bf16[2048,4096]{1,0}, u32[], token[]) send(%x, %after-all), channel_id=1, frontend_attributes={_xla_send_recv_source_target_pairs={{3,0}}}
  %dot = bf16[4096,4096]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bwd-recv-done = (bf16[2048,4096]{1,0}, token[]) recv-done(%bwd-recv), channel_id=1
  %bwd-send-done = token[] send-done(%bwd-send), channel_id=1
  %fwd-recv-done = (bf16[2048,4096]{1,0}, token[]) recv-done(%fwd-recv), channel_id=2
  %fwd-send-done = token[] send-done(%fwd-send), channel_id=2
  %data = bf16[2048,4096]{1,0} get-tuple-element(%fwd-recv-done), index=0
  ROOT %out = (bf16[4096,4096]{1,0}, bf16[2048,4096]{1,0}) tuple(%dot, %data)
}
"""


def test_a_decomposed_permute_is_one_pipe_collective_with_the_gemm_under_it():
    sizes = {"data": 1, "pipe": 4}
    (found,) = collectives(_SEND_RECV, sizes)
    assert (found.kind, found.axes, found.bytes) == ("collective-permute", ("pipe",), 2048 * 4096 * 2)
    (window,) = collective_windows(_SEND_RECV, sizes)
    assert (window.start, window.done, window.synchronous) == ("fwd-send", "fwd-send-done", False)
    assert "dot" in [i.name for i in window.between]
    estimate = estimate_step(_SEND_RECV, sizes, "h100", tokens_per_step=1, model_flops_per_step=1.0)
    assert estimate.bytes_by_axes[("pipe",)] == found.bytes
    assert estimate.hidden_fraction_by_axes[("pipe",)] == pytest.approx(1.0)


_SMALL_GPU = ["model.hidden=256", "model.heads=4", "model.mlp_dim=1024", "model.seq_len=256", "model.vocab_size=256",
              "model.dtype=bfloat16", "model.layers=4", "parallel.zero=1", "train.batch_size=16"]


_P2P_FLAGS = "--xla_gpu_enable_pipelined_p2p=true --xla_gpu_collective_permute_decomposer_threshold=0"


def _pipe_windows_with_gemms(text: str, sizes: dict[str, int]) -> list[str]:
    """The pipe axis's asynchronous collectives with a GEMM scheduled between start and done (in a
    stage's ``conditional`` included)."""
    from meshtron.hlo.gemms import GemmFinder, gemms_launched
    from meshtron.hlo.schedule import module_of

    module = module_of(text)
    finder = GemmFinder(module)
    return [w.start for w in collective_windows(module, sizes) if "pipe" in w.collective.axes and not w.synchronous
            and gemms_launched(w.between, module.computations[w.computation], finder) > 0]


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_overlap_on_puts_the_backward_gemms_under_the_pipe_sends_on_h100(gpu_target):
    """``gpu.overlap=on`` sends early on a GPU: the 1F1B tick loop's permutes are in flight while a stage's
    ``conditional`` runs its GEMMs, which the chained order (off) never allows; the order is proved by the
    schedule, not by data. Off, no GEMM is under a pipe collective (an expert's pipelined p2p, whose
    send/recv pairs have small fusions under them: benchmarks/2026-11-30-overlap.md)."""
    from meshtron.hlo.order import unordered_collectives
    from meshtron.train.loop import Trainer

    layout = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.schedule=1f1b",
              "parallel.microbatches=2", "model.layers=2", "train.batch_size=8"]
    hidden, under = {}, {}
    for setting in ("off", "on"):
        extra = {"off": [], "on": ["gpu.overlap=on"]}[setting]
        trainer = Trainer.from_config(load_config(None, [*_SMALL_GPU, *layout, *extra]), target=gpu_target,
                                      read_data=False)
        params, opt_state, tokens = trainer.abstract_step_arguments()
        text = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0]).as_text()
        sizes = dict(trainer.mesh.shape)
        estimate = estimate_step(text, sizes, gpu_target, tokens_per_step=1, model_flops_per_step=1.0)
        hidden[setting] = estimate.hidden_fraction_by_axes[("pipe",)]
        under[setting] = _pipe_windows_with_gemms(text, sizes)
        assert unordered_collectives(text, in_schedule_order=True) == []
        # the data rule, which XLA:CPU's runtime needs, holds for the chained order only
        assert (unordered_collectives(text) == []) == (setting == "off")
    assert under["off"] == [] and under["on"]
    assert hidden["on"] > hidden["off"]


# A microbatch loop as the collective pipeliner leaves it: XLA recorded only its induction variable,
# not its trip count; it counts from 0 (through a copy) while i < 30, its compare fused.
_PEELED_LOOP = """HloModule jit_step, is_scheduled=true

%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %bound = s32[] constant(30)
  ROOT %lt = pred[] compare(%p, %bound), direction=LT
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%b), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%j, %one)
  %x = f32[8]{0} get-tuple-element(%b), index=1
  %sum = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %sum)
}

%add (l: f32[], r: f32[]) -> f32[] {
  %l = f32[] parameter(0)
  %r = f32[] parameter(1)
  ROOT %s = f32[] add(%l, %r)
}

ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[8]{0}) tuple(%start, %x)
  ROOT %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
}
"""


def test_a_loop_without_a_recorded_trip_count_is_counted_from_its_bounds():
    (found,) = collectives(_PEELED_LOOP, {"data": 2})
    assert (found.kind, found.count, found.unknown_trip_count) == ("all-reduce", 30, False)
    # a bound the loop does not compare against a constant stays unknown
    (unknown,) = collectives(_PEELED_LOOP.replace("%bound = s32[] constant(30)", "%bound = s32[] parameter(1)"),
                             {"data": 2})
    assert (unknown.count, unknown.unknown_trip_count) == (1, True)


def test_overlap_on_is_the_pipelined_all_reduce_and_an_experts_flags_come_on_top():
    assert compiler_options("on") == {"xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_ON"} == OVERLAP_ON
    assert compiler_options("on", _P2P_FLAGS) == {**OVERLAP_ON, "xla_gpu_enable_pipelined_p2p": True,
                                                  "xla_gpu_collective_permute_decomposer_threshold": 0}


# A schedule's structure, smallest: one layer per stage and chunk (interleaved's 2 chunks: 4 layers), as many
# microbatches as stages; what is compiled is the schedule's tick loop, whatever the model's size.
_SCHEDULE_GPU = ["model.hidden=64", "model.heads=4", "model.mlp_dim=128", "model.seq_len=64", "model.vocab_size=256",
                 "model.dtype=bfloat16", "parallel.zero=1", "train.batch_size=8"]


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("schedule", [  # one compile in the CI tier (interleaved: chunked stages); make test runs all
    *[pytest.param(schedule, marks=pytest.mark.extended) for schedule in ("gpipe", "1f1b", "1f1b-p")],
    "interleaved", pytest.param("zb-h1", marks=pytest.mark.extended)])
def test_overlap_on_compiles_every_pipeline_schedule_for_h100(gpu_target, schedule):
    """With cuDNN attention and FP8 projections (what XLA aborted on when the bundle held pipelined p2p) and
    the early sends: every schedule compiles, and its order is proved by the schedule."""
    from meshtron.hlo.order import unordered_collectives
    from meshtron.train.loop import Trainer

    layout = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", f"parallel.schedule={schedule}",
              "parallel.microbatches=2", f"model.layers={4 if schedule == 'interleaved' else 2}",
              *(["parallel.chunks=2"] if schedule == "interleaved" else []),
              "model.attention=cudnn", "model.fp8=current"]
    trainer = Trainer.from_config(load_config(None, [*_SCHEDULE_GPU, *layout, "gpu.overlap=on"]), target=gpu_target,
                                  read_data=False)
    assert trainer.steps.compiler_options == for_this_xla(OVERLAP_ON)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    text = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0]).as_text()
    assert "is_scheduled=true" in text and '_xla_gpu_collective_stream="p2p"' in text
    assert unordered_collectives(text, in_schedule_order=True) == []
