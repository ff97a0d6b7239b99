"""``gpu.overlap`` and ``gpu.xla_flags``: parsed into typed XLA compiler options, checked as config
fields, handed to every program of a run, the same losses on the CPU either way; compiled for 8 H100s,
every pipeline schedule with ``gpu.overlap=on``, and more of the pipe communication hidden with an
expert's pipelined p2p. Also the schedule of a
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


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_pipelined_p2p_hides_more_of_the_pipe_axis_on_h100(gpu_target):
    """An expert's pipelined p2p (``gpu.xla_flags``): the 1F1B runtime's permutes become asynchronous
    send/recv pairs with work under them. ``gpu.overlap=on``'s own gain -- sequence parallelism's
    reduce-scatters pipelined across layers on the tensor axis -- shows on the 7B step of
    benchmarks/overlap_flags.py, not on a model this small."""
    from meshtron.train.loop import Trainer

    layout = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.schedule=1f1b",
              "parallel.microbatches=4"]
    hidden = {}
    for flags in (None, _P2P_FLAGS):
        cfg = load_config(None, [*_SMALL_GPU, *layout, *([f"gpu.xla_flags={flags}"] if flags else [])])
        trainer = Trainer.from_config(cfg, target=gpu_target, read_data=False)
        params, opt_state, tokens = trainer.abstract_step_arguments()
        text = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0]).as_text()
        estimate = estimate_step(text, dict(trainer.mesh.shape), gpu_target, tokens_per_step=1, model_flops_per_step=1.0)
        hidden[flags] = estimate.hidden_fraction_by_axes[("pipe",)]
    assert hidden[_P2P_FLAGS] > hidden[None]


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


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1"])
def test_overlap_on_compiles_every_pipeline_schedule_for_h100(gpu_target, schedule):
    """With cuDNN attention and FP8 projections: what XLA aborted on when the bundle held pipelined p2p."""
    from meshtron.train.loop import Trainer

    layout = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", f"parallel.schedule={schedule}",
              "parallel.microbatches=4", *(["parallel.chunks=2"] if schedule == "interleaved" else []),
              "model.attention=cudnn", "model.fp8=current"]
    trainer = Trainer.from_config(load_config(None, [*_SMALL_GPU, *layout, "gpu.overlap=on"]), target=gpu_target,
                                  read_data=False)
    assert trainer.steps.compiler_options == for_this_xla(OVERLAP_ON)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    assert "is_scheduled=true" in trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0]).as_text()
