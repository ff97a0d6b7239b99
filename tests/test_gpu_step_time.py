"""The scheduled-HLO overlap finder and the GPU step-time estimate: windows of a handwritten
scheduled program, the estimate's arithmetic on it, and GEMM FLOPs and collective bytes of a
program XLA:GPU compiled."""

from __future__ import annotations

import math

import pytest

from meshtron.errors import ConfigError
from meshtron.gpu.step_time import (
    estimate_step,
    fit_gemm_efficiency,
    flop_floor_seconds,
    gemm_flops,
    model_flops,
)
from meshtron.hlo.collectives import bytes_by_axes, collectives, ring_wire_bytes
from meshtron.hlo.schedule import collective_windows
from meshtron.plan.cluster import load_cluster

# 16 devices, two nodes of 8: tensor groups stay in a node, data groups ({0,8}, {1,9}, ...) cross.
SIZES = {"data": 2, "tensor": 8}
_CONFIG = ('backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":%s,'
           '"is_pipelined":false}}')
_ASYNC, _SYNC = _CONFIG % "false", _CONFIG % "true"
_GEMM = ('custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":'
         '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
         '"rhs_batch_dimensions":[]}}}')

SCHEDULED = f"""HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}}

%triton_gemm (p0: bf16[128,512], p1: bf16[512,512]) -> bf16[128,512] {{
  %p0 = bf16[128,512]{{1,0}} parameter(0)
  %p1 = bf16[512,512]{{1,0}} parameter(1)
  ROOT %dot.1 = bf16[128,512]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%scale (q0: bf16[128,512]) -> bf16[128,512] {{
  %q0 = bf16[128,512]{{1,0}} parameter(0)
  ROOT %m = bf16[128,512]{{1,0}} multiply(%q0, %q0)
}}

%body (state: (s32[], bf16[128,512])) -> (s32[], bf16[128,512]) {{
  %state = (s32[], bf16[128,512]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = bf16[128,512]{{1,0}} get-tuple-element(%state), index=1
  %cp-start = ((bf16[128,512]{{1,0}}), bf16[128,512]{{1,0}}) collective-permute-start(%x), channel_id=3, source_target_pairs={{{{0,8}},{{8,0}}}}, {_ASYNC}
  %square = bf16[128,512]{{1,0}} fusion(%x), kind=kLoop, calls=%scale
  %cp-done = bf16[128,512]{{1,0}} collective-permute-done(%cp-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[128,512]{{1,0}}) tuple(%next, %cp-done)
}}

%cond (cstate: (s32[], bf16[128,512])) -> pred[] {{
  %cstate = (s32[], bf16[128,512]{{1,0}}) parameter(0)
  %ci = s32[] get-tuple-element(%cstate), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %three), direction=LT
}}

ENTRY %main (x: bf16[128,256], w: bf16[256,512], v: bf16[64,512]) -> bf16[128,512] {{
  %x = bf16[128,256]{{1,0}} parameter(0)
  %w = bf16[256,512]{{1,0}} parameter(1)
  %v = bf16[64,512]{{1,0}} parameter(2)
  %ag-start = ((bf16[64,512]{{1,0}}), bf16[512,512]{{1,0}}) all-gather-start(%v), channel_id=1, replica_groups=[2,8]<=[16], dimensions={{0}}, use_global_device_ids=true, {_ASYNC}
  %gemm = (bf16[128,512]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %w), {_GEMM}
  %h = bf16[128,512]{{1,0}} get-tuple-element(%gemm), index=0
  %ag-done = bf16[512,512]{{1,0}} all-gather-done(%ag-start)
  %y = bf16[128,512]{{1,0}} fusion(%h, %ag-done), kind=kCustom, calls=%triton_gemm
  %ar-start = ((bf16[128,512]{{1,0}}), bf16[128,512]{{1,0}}) all-reduce-start(%y), channel_id=2, replica_groups=[8,2]<=[2,8]T(1,0), use_global_device_ids=true, to_apply=%add, {_SYNC}
  %ar-done = bf16[128,512]{{1,0}} all-reduce-done(%ar-start)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[128,512]{{1,0}}) tuple(%zero, %ar-done)
  %loop = (s32[], bf16[128,512]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  ROOT %result = bf16[128,512]{{1,0}} get-tuple-element(%loop), index=1
}}
"""

H100 = load_cluster("h100-80gb")
BF16_128x512 = 128 * 512 * 2


def _windows():
    return {w.start: w for w in collective_windows(SCHEDULED, SIZES)}


def test_windows_of_a_scheduled_program_hold_the_compute_between_start_and_done():
    windows = _windows()
    assert set(windows) == {"ag-start", "ar-start", "cp-start"}
    gather = windows["ag-start"]
    assert (gather.kind, gather.collective.axes, gather.done, gather.synchronous) == (
        "all-gather", ("tensor",), "ag-done", False)
    assert [i.name for i in gather.between] == ["gemm", "h"]
    assert gather.collective.bytes == 512 * 512 * 2 and gather.collective.count == 1
    reduce = windows["ar-start"]  # is_sync: hides nothing
    assert (reduce.kind, reduce.collective.axes, reduce.synchronous, reduce.between) == (
        "all-reduce", ("data",), True, ())
    assert reduce.collective.bytes == BF16_128x512  # the result, not the (operands, results) tuple
    permute = windows["cp-start"]
    assert (permute.computation, permute.collective.count, permute.collective.axes) == ("body", 3, ("data",))
    assert [i.name for i in permute.between] == ["square"]


def test_plain_collectives_are_synchronous_windows():
    text = SCHEDULED.replace(
        "%ar-start = ((bf16[128,512]{1,0}), bf16[128,512]{1,0}) all-reduce-start(%y)",
        "%ar-start = bf16[128,512]{1,0} all-reduce(%y)").replace("%ar-done = bf16[128,512]{1,0} all-reduce-done(%ar-start)",
                                                                "%ar-done = bf16[128,512]{1,0} copy(%ar-start)")
    reduce = {w.start: w for w in collective_windows(text, SIZES)}["ar-start"]
    assert reduce.synchronous and reduce.between == () and reduce.done == "ar-start"


def test_estimate_of_the_handwritten_program_hides_each_collective_under_its_window():
    efficiency = 0.5
    estimate = estimate_step(SCHEDULED, SIZES, "h100", tokens_per_step=128, model_flops_per_step=1e9,
                             gemm_efficiency=efficiency)
    gemm_rate = H100.peak_tflops * 1e12 * efficiency
    hbm = H100.hbm_gbps * 1e9 * H100.memory_efficiency
    nvlink = H100.nvlink_gbps * 1e9 * H100.nvlink_efficiency
    network = H100.network_gbps / H100.gpus_per_node * 1e9 * H100.network_efficiency
    gemm1 = 2 * 128 * 512 * 256 / gemm_rate
    gemm2 = 2 * 128 * 512 * 512 / gemm_rate
    gather = ring_wire_bytes("all-gather", 512 * 512 * 2, 8) / nvlink + 7 * H100.nvlink_latency_us * 1e-6
    reduce = ring_wire_bytes("all-reduce", BF16_128x512, 2) / network + 2 * H100.network_latency_us * 1e-6
    square = 2 * BF16_128x512 / hbm
    loop_control = (3 * (4 + 4 + 4) + 4 * (4 + 4 + 1)) / hbm  # the body's s32 add, the condition's compare
    permute = BF16_128x512 / network + H100.network_latency_us * 1e-6
    exposed = max(0.0, gather - gemm1) + reduce + 3 * max(0.0, permute - square)
    assert estimate.compute_seconds == pytest.approx(gemm1 + gemm2)
    assert estimate.gemm_flops == pytest.approx(2 * 128 * 512 * (256 + 512))
    assert estimate.memory_seconds == pytest.approx(3 * square + loop_control)
    assert estimate.communication_seconds == pytest.approx(gather + reduce + 3 * permute)
    assert estimate.exposed_communication_seconds == pytest.approx(exposed)
    assert estimate.seconds == pytest.approx(gemm1 + gemm2 + 3 * square + loop_control + exposed)
    assert estimate.seconds == pytest.approx(
        estimate.compute_seconds + estimate.memory_seconds + estimate.exposed_communication_seconds)
    assert estimate.hidden_fraction_by_axes[("tensor",)] == pytest.approx(min(1.0, gemm1 / gather))
    assert estimate.bytes_by_axes == {("tensor",): 512 * 512 * 2, ("data",): 4 * BF16_128x512}
    assert estimate.bytes_by_axes == bytes_by_axes(collectives(SCHEDULED, SIZES))
    assert estimate.mfu == pytest.approx(1e9 / (estimate.seconds * 16 * H100.peak_tflops * 1e12))
    assert estimate.tokens_per_s_per_gpu == pytest.approx(128 / estimate.seconds / 16)
    assert any("hidden" in line for line in estimate.lines())


def test_causal_halved_mfu_counts_half_the_attention_flops():
    total, attention = model_flops(params=1000, layers=2, hidden=64, seq_len=128, tokens=256)
    assert attention == 12 * 2 * 64 * 128 * 256 and total == 6 * 1000 * 256 + attention
    estimate = estimate_step(SCHEDULED, SIZES, "h100", tokens_per_step=256, model_flops_per_step=total,
                             causal_attention_flops_per_step=attention)
    assert estimate.mfu_causal_halved == pytest.approx(estimate.mfu * (total - attention / 2) / total)


def test_flop_floor_is_the_gemm_time_of_exactly_the_models_flops_and_bounds_the_estimate():
    # The handwritten program's GEMMs are its only work that counts as model FLOPs: on 16 devices the
    # floor is its GEMM time, and its estimate (memory-bound work, exposed collectives) lies above.
    estimate = estimate_step(SCHEDULED, SIZES, "h100", tokens_per_step=1, model_flops_per_step=1.0,
                             gemm_efficiency=0.5)
    floor = flop_floor_seconds("h100", 16, model_flops_per_step=16 * estimate.gemm_flops, gemm_efficiency=0.5)
    assert floor == pytest.approx(estimate.compute_seconds)
    assert floor < estimate.seconds
    attention = 2e9  # the causal half of the attention FLOPs is skipped
    assert flop_floor_seconds("h100", 16, model_flops_per_step=1e12 + attention, causal_attention_flops_per_step=attention,
                              gemm_efficiency=0.5) == pytest.approx((1e12 + attention / 2) / (16 * H100.peak_tflops * 0.5e12))
    with pytest.raises(ConfigError, match="gpus: a positive number of GPUs"):
        flop_floor_seconds("h100", 0, model_flops_per_step=1.0)


def test_fit_gemm_efficiency_inverts_the_estimate():
    measured = estimate_step(SCHEDULED, SIZES, "h100", tokens_per_step=1, model_flops_per_step=1.0,
                             gemm_efficiency=0.37).seconds
    fitted = fit_gemm_efficiency(SCHEDULED, SIZES, "h100", measured_seconds=measured)
    assert fitted == pytest.approx(0.37, rel=1e-6)


def test_fit_gemm_efficiency_refuses_a_time_faster_than_the_peak():
    with pytest.raises(ConfigError, match="measured_seconds: .* faster than the estimate at the dense peak"):
        fit_gemm_efficiency(SCHEDULED, SIZES, "h100", measured_seconds=1e-9)


def test_bad_gemm_efficiency_is_one_config_error():
    with pytest.raises(ConfigError, match=r"gemm_efficiency: a fraction of the dense peak in \(0, 1\]"):
        estimate_step(SCHEDULED, SIZES, "h100", tokens_per_step=1, model_flops_per_step=1.0, gemm_efficiency=1.5)


# --------------------------------------------------------------------------------------------------
# A pipelined program priced per tick
# --------------------------------------------------------------------------------------------------

_SLOT = 'metadata={op_name="jit(train)/shard_map/while/body/eval_jaxpr/pipeline_%s/cond"}'
# Two ticks in a loop (forward, backward each), a third unrolled (forward). A forward's run branch
# squares a 512x512 f32 array (3 MiB moved); a backward's squares it and holds a nested cond (not a slot)
# that squares it again; skipping is free.
PIPELINED = f"""HloModule jit_train, is_scheduled=true

%run_f (a: f32[512,512]) -> f32[512,512] {{
  %a = f32[512,512]{{1,0}} parameter(0)
  ROOT %fa = f32[512,512]{{1,0}} multiply(%a, %a)
}}

%skip (k: f32[512,512]) -> f32[512,512] {{
  ROOT %k = f32[512,512]{{1,0}} parameter(0)
}}

%run_b (c: f32[512,512]) -> f32[512,512] {{
  %c = f32[512,512]{{1,0}} parameter(0)
  %bc = f32[512,512]{{1,0}} multiply(%c, %c)
  %always = pred[] constant(true)
  ROOT %inner = f32[512,512]{{1,0}} conditional(%always, %bc, %bc), true_computation=%run_f, false_computation=%skip, metadata={{op_name="jit(train)/shard_map/while/body/eval_jaxpr/pipeline_backward/cond/branch_1_fun/cond"}}
}}

%tick (state: (s32[], f32[512,512])) -> (s32[], f32[512,512]) {{
  %state = (s32[], f32[512,512]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[512,512]{{1,0}} get-tuple-element(%state), index=1
  %turn = pred[] constant(true)
  %fwd = f32[512,512]{{1,0}} conditional(%turn, %x, %x), true_computation=%run_f, false_computation=%skip, {_SLOT % "forward"}
  %bwd = f32[512,512]{{1,0}} conditional(%turn, %fwd, %fwd), true_computation=%run_b, false_computation=%skip, {_SLOT % "backward"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[512,512]{{1,0}}) tuple(%next, %bwd)
}}

%more (cstate: (s32[], f32[512,512])) -> pred[] {{
  %cstate = (s32[], f32[512,512]{{1,0}}) parameter(0)
  %ci = s32[] get-tuple-element(%cstate), index=0
  %two = s32[] constant(2)
  ROOT %lt = pred[] compare(%ci, %two), direction=LT
}}

ENTRY %main (x: f32[512,512]) -> f32[512,512] {{
  %x = f32[512,512]{{1,0}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[512,512]{{1,0}}) tuple(%zero, %x)
  %ticks = (s32[], f32[512,512]{{1,0}}) while(%init), condition=%more, body=%tick, backend_config={{"known_trip_count":{{"n":"2"}}}}
  %y = f32[512,512]{{1,0}} get-tuple-element(%ticks), index=1
  %index = s32[] constant(1)
  ROOT %last = f32[512,512]{{1,0}} conditional(%index, %y, %y), branch_computations={{%skip, %run_f}}, {_SLOT % "forward"}
}}
"""
PIPE = {"pipe": 2}


def _table(*slots):
    from meshtron.gpu.slots import Slot, TickTable

    return TickTable(tuple(Slot(tick, kind, runs) for tick, kind, runs in slots))


# tick 0: stage 0 forwards; tick 1: stage 1 forwards while stage 0 runs a backward; tick 2: nobody forwards
TICKS = _table((0, "forward", (True, False)), (0, "backward", (False, False)),
               (1, "forward", (False, True)), (1, "backward", (True, False)), (2, "forward", (False, False)))


def test_a_pipelined_program_is_priced_per_tick_at_its_slowest_stage():
    from meshtron.gpu.step_time import slot_seconds

    square = 3 * 512 * 512 * 4 / (H100.hbm_gbps * 1e9 * H100.memory_efficiency)
    forward, backward = square, 2 * square  # the backward's nested cond priced at its costliest branch
    branches = slot_seconds(PIPELINED, PIPE, "h100", TICKS)
    assert [run for run, _ in branches] == pytest.approx([forward, backward, forward, backward, forward])
    assert [skip for _, skip in branches] == [0.0] * 5
    plain = estimate_step(PIPELINED, PIPE, "h100", tokens_per_step=1, model_flops_per_step=1.0)
    ticked = estimate_step(PIPELINED, PIPE, "h100", tokens_per_step=1, model_flops_per_step=1.0, ticks=TICKS)
    assert not plain.per_tick and ticked.per_tick
    # costliest branches: 3 forwards + 2 backwards; per tick: tick 0 a forward, tick 1 stage 0's backward
    # (its slots cost more than stage 1's forward), tick 2 nothing
    assert plain.seconds - ticked.seconds == pytest.approx(2 * forward + backward)
    assert plain.memory_seconds - ticked.memory_seconds == pytest.approx(2 * forward + backward)
    assert ticked.seconds == pytest.approx(ticked.compute_seconds + ticked.memory_seconds
                                           + ticked.exposed_communication_seconds)


def test_a_tick_table_that_is_not_the_programs_is_one_config_error():
    with pytest.raises(ConfigError, match="ticks: the program runs 5 pipeline slot conditionals and the tick table "
                                          "has 4 slots"):
        estimate_step(PIPELINED, PIPE, "h100", tokens_per_step=1, model_flops_per_step=1.0,
                      ticks=_table(*((s.tick, s.kind, s.runs) for s in TICKS.slots[:4])))
    swapped = _table(*((s.tick, {"forward": "backward", "backward": "forward"}[s.kind], s.runs) for s in TICKS.slots))
    with pytest.raises(ConfigError, match="ticks: the program's slot 0 .* is a forward and the table's a backward"):
        estimate_step(PIPELINED, PIPE, "h100", tokens_per_step=1, model_flops_per_step=1.0, ticks=swapped)


def test_a_tick_table_changes_nothing_in_a_program_without_slots():
    plain = estimate_step(SCHEDULED, SIZES, "h100", tokens_per_step=1, model_flops_per_step=1.0)
    ticked = estimate_step(SCHEDULED, SIZES, "h100", tokens_per_step=1, model_flops_per_step=1.0, ticks=TICKS)
    assert ticked == plain and not ticked.per_tick


# --------------------------------------------------------------------------------------------------
# A program XLA:GPU compiled
# --------------------------------------------------------------------------------------------------

_OVERRIDES = ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "parallel.microbatches=1",
              "model.layers=2", "train.batch_size=8"]


@pytest.fixture(scope="module")
def compiled_gpu_program():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for a GPU target needs the gpu-compile extra")
    from meshtron.config import load_config
    from meshtron.train.loop import Trainer

    cfg = load_config("cpu8", _OVERRIDES)
    trainer = Trainer.from_config(cfg, target="h100", read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    compiled = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0])
    return cfg, dict(trainer.mesh.shape), compiled.as_text()


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_gemm_flops_of_a_compiled_program_are_the_models(compiled_gpu_program):
    cfg, sizes, text = compiled_gpu_program
    m = cfg.model
    h, layers, s = m.hidden, m.layers, m.seq_len
    matmul_params = layers * (4 * h * h + 2 * h * m.mlp_dim) + m.vocab_size * h  # the embedding lookup is no GEMM
    tokens = cfg.train.batch_size * s
    total, _ = model_flops(params=matmul_params, layers=layers, hidden=h, seq_len=s, tokens=tokens)
    gpus = math.prod(sizes.values())
    assert gemm_flops(text) * gpus == pytest.approx(total, rel=1e-9)
    estimate = estimate_step(text, sizes, "h100", tokens_per_step=tokens, model_flops_per_step=total)
    assert estimate.gemm_flops * gpus == pytest.approx(total, rel=1e-9)


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_collective_bytes_of_a_compiled_program_match_hlo_collectives(compiled_gpu_program):
    _, sizes, text = compiled_gpu_program
    estimate = estimate_step(text, sizes, "h100", tokens_per_step=1, model_flops_per_step=1.0)
    assert estimate.bytes_by_axes == bytes_by_axes(collectives(text, sizes))
    assert estimate.bytes_by_axes[("data",)] > 0  # the gradient reduction
    windows = collective_windows(text, sizes)
    assert all(w.between == () for w in windows if w.synchronous)
    assert any(not w.synchronous for w in windows)


_FMHA = """HloModule attention, is_scheduled=true

ENTRY %main (q: bf16[2,1024,8,64], k: bf16[2,1024,8,64], v: bf16[2,1024,8,64], do: bf16[2,8,1024,64]) -> bf16[2,8,1024,64] {
  %q = bf16[2,1024,8,64]{3,2,1,0} parameter(0)
  %k = bf16[2,1024,8,64]{3,2,1,0} parameter(1)
  %v = bf16[2,1024,8,64]{3,2,1,0} parameter(2)
  %do = bf16[2,8,1024,64]{3,2,1,0} parameter(3)
  %fwd = (bf16[2,8,1024,64]{3,1,2,0}, f32[2,8,1024]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"fmha_scale":0.125,"mask_type":"MASK","bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","2"],"rhs_batch_dimensions":["0","2"]}}}
  %o = bf16[2,8,1024,64]{3,1,2,0} get-tuple-element(%fwd), index=0
  %bwd = (bf16[2,1024,8,64]{3,2,1,0}, bf16[2,1024,8,64]{3,2,1,0}, bf16[2,1024,8,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v, %o, %do), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"mask_type":"MASK","intermediate_tensor_shape":{"element_type":"BF16","dimensions":["2","8","1024","1024"]}}}
  ROOT %dq = bf16[2,1024,8,64]{3,2,1,0} get-tuple-element(%bwd), index=0
}
"""


@pytest.mark.parametrize("mask, factor", [("NO_MASK", 1.0), ("CAUSAL", 0.5)])
def test_cudnn_fused_attention_flops_from_operand_shapes(mask, factor):
    forward = 4 * 2 * 8 * 1024 * 1024 * 64  # scores and their product with the values
    assert gemm_flops(_FMHA.replace("MASK", mask)) == pytest.approx(factor * 3.5 * forward)  # backward 2.5x


_STACKED = """HloModule stacked, is_scheduled=true

%read_layer (s0: bf16[32,64,128], i0: s32[]) -> bf16[1,64,128] {
  %s0 = bf16[32,64,128]{2,1,0} parameter(0)
  %view = bf16[32,8192]{1,0} bitcast(%s0)
  %i0 = s32[] parameter(1)
  %z0 = s32[] constant(0)
  %row = bf16[1,8192]{1,0} dynamic-slice(%view, %i0, %z0), dynamic_slice_sizes={1,8192}
  ROOT %layer = bf16[1,64,128]{2,1,0} bitcast(%row)
}

%write_layer (u1: bf16[1,64,128], i1: s32[], s1: bf16[32,64,128]) -> bf16[32,64,128] {
  %u1 = bf16[1,64,128]{2,1,0} parameter(0)
  %i1 = s32[] parameter(1)
  %s1 = bf16[32,64,128]{2,1,0} parameter(2)
  %z1 = s32[] constant(0)
  ROOT %put = bf16[32,64,128]{2,1,0} dynamic-update-slice(%s1, %u1, %i1, %z1, %z1)
}

ENTRY %main (stack: bf16[32,64,128], i: s32[]) -> bf16[32,64,128] {
  %stack = bf16[32,64,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %got = bf16[1,64,128]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%read_layer
  ROOT %new = bf16[32,64,128]{2,1,0} fusion(%got, %i, %stack), kind=kLoop, calls=%write_layer
}
"""


def test_slices_of_a_stacked_buffer_move_only_the_slice():
    estimate = estimate_step(_STACKED, {"data": 1}, "h100", tokens_per_step=1, model_flops_per_step=1.0)
    layer = 64 * 128 * 2
    moved = (layer + 4 + layer) + (layer + 4 + layer)  # read a slice (and the index), write a layer; in place
    assert estimate.memory_seconds == pytest.approx(moved / (H100.hbm_gbps * 1e9 * H100.memory_efficiency))


_RING_BUFFER = """HloModule ring_buffer, is_scheduled=true

%chunk_of_products (p0: bf16[64,128], p1: bf16[64,128], p2: bf16[64,128], p3: bf16[64,128], i: s32[]) -> bf16[64,128] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[64,128]{1,0} parameter(1)
  %p2 = bf16[64,128]{1,0} parameter(2)
  %p3 = bf16[64,128]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %zero = bf16[] constant(0)
  %z = s32[] constant(0)
  %c64 = s32[] constant(64)
  %c128 = s32[] constant(128)
  %c192 = s32[] constant(192)
  %padded = bf16[256,128]{1,0} pad(%p0, %zero), padding=0_192x0_0
  %d1 = bf16[256,128]{1,0} dynamic-update-slice(%padded, %p1, %c64, %z)
  %d2 = bf16[256,128]{1,0} dynamic-update-slice(%d1, %p2, %c128, %z)
  %d3 = bf16[256,128]{1,0} dynamic-update-slice(%d2, %p3, %c192, %z)
  %e = bf16[256,128]{1,0} exponential(%d3)
  ROOT %s = bf16[64,128]{1,0} dynamic-slice(%e, %i, %z), dynamic_slice_sizes={64,128}
}

%gathered (q0: bf16[64,128], q1: bf16[64,128], q2: bf16[64,128], q3: bf16[64,128]) -> bf16[256,128] {
  %q0 = bf16[64,128]{1,0} parameter(0)
  %q1 = bf16[64,128]{1,0} parameter(1)
  %q2 = bf16[64,128]{1,0} parameter(2)
  %q3 = bf16[64,128]{1,0} parameter(3)
  %all = bf16[256,128]{1,0} concatenate(%q0, %q1, %q2, %q3), dimensions={0}
  ROOT %t = bf16[128,256]{1,0} transpose(%all), dimensions={1,0}
}

%first_of_sum (r0: f32[2,64,128]) -> f32[1] {
  %r0 = f32[2,64,128]{2,1,0} parameter(0)
  %zero = f32[] constant(0)
  %sum = f32[64,128]{1,0} reduce(%r0, %zero), dimensions={0}, to_apply=%add
  %flat = f32[8192]{0} bitcast(%sum)
  ROOT %first = f32[1]{0} slice(%flat), slice={[0:1]}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: bf16[64,128], b: bf16[64,128], c: bf16[64,128], d: bf16[64,128], i: s32[], r: f32[2,64,128]) -> bf16[64,128] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[64,128]{1,0} parameter(1)
  %c = bf16[64,128]{1,0} parameter(2)
  %d = bf16[64,128]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %whole = bf16[128,256]{1,0} fusion(%a, %b, %c, %d), kind=kLoop, calls=%gathered
  %r = f32[2,64,128]{2,1,0} parameter(5)
  %one = f32[1]{0} fusion(%r), kind=kLoop, calls=%first_of_sum
  ROOT %one = bf16[64,128]{1,0} fusion(%a, %b, %c, %d, %i), kind=kLoop, calls=%chunk_of_products
}
"""


def test_a_chunk_read_out_of_a_buffer_the_products_fill_moves_one_chunk():
    # A ring's steps write their products into one buffer (pad, then dynamic-update-slices), and a fusion
    # reads one chunk of it back through element-wise work: its kernel reads one chunk's elements, not
    # every product whole; the buffer gathered whole (a concatenate, transposed) reads every product once;
    # one element of a sum over the leading dimension reads the two elements it adds.
    estimate = estimate_step(_RING_BUFFER, {"data": 1}, "h100", tokens_per_step=1, model_flops_per_step=1.0)
    chunk = 64 * 128 * 2
    moved = (chunk + 4 + chunk) + (4 * chunk + 4 * chunk) + (2 * 4 + 4)  # one chunk (and the index); all; a sum
    assert estimate.memory_seconds == pytest.approx(moved / (H100.hbm_gbps * 1e9 * H100.memory_efficiency))


_PIPELINED_OVERRIDES = ["parallel.data=4", "parallel.pipe=2", "parallel.tensor=1", "parallel.chunks=1",
                        "parallel.microbatches=2", "model.layers=2", "train.batch_size=8", "model.seq_len=64"]


@pytest.fixture(scope="module", params=[  # the CI tier prices zb-h1 (its split backward); make test all three
    pytest.param("1f1b", marks=pytest.mark.extended), "zb-h1", pytest.param("1f1b-p", marks=pytest.mark.extended)])
def compiled_pipelined_program(request):
    pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for a GPU target needs the gpu-compile extra")
    from meshtron.config import load_config
    from meshtron.train.loop import Trainer

    cfg = load_config("llama_cpu8", [*_PIPELINED_OVERRIDES, f"parallel.schedule={request.param}"])
    trainer = Trainer.from_config(cfg, target="h100", read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    compiled = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0])
    return trainer.resolved, dict(trainer.mesh.shape), compiled.as_text()


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_a_compiled_pipeline_is_priced_per_tick_from_its_branches(compiled_pipelined_program):
    from meshtron.gpu.pipeline_ticks import tick_table
    from meshtron.gpu.slots import slot_conditionals
    from meshtron.gpu.step_time import slot_seconds
    from meshtron.hlo.schedule import module_of

    run, sizes, text = compiled_pipelined_program
    ticks = tick_table(run.program)
    # every slot the runtime traced is one named conditional, executed in the table's order
    assert [c.kind for c in slot_conditionals(module_of(text))] == [slot.kind for slot in ticks.slots]
    branches = slot_seconds(text, sizes, "h100", ticks)
    assert all(work > skip for work, skip in branches)  # the true branch runs the stage
    plain = estimate_step(text, sizes, "h100", tokens_per_step=1, model_flops_per_step=1.0)
    ticked = estimate_step(text, sizes, "h100", tokens_per_step=1, model_flops_per_step=1.0, ticks=ticks)
    by_tick: dict[int, list[int]] = {}
    for index, slot in enumerate(ticks.slots):
        by_tick.setdefault(slot.tick, []).append(index)
    slowest_stages = sum(max(sum(branches[k][0] if ticks.slots[k].runs[stage] else branches[k][1] for k in indices)
                             for stage in range(ticks.stages)) for indices in by_tick.values())
    costliest = sum(max(work, skip) for work, skip in branches)
    assert ticked.per_tick and not plain.per_tick
    assert ticked.seconds == pytest.approx(plain.seconds - costliest + slowest_stages, rel=1e-9)
    assert ticked.seconds < plain.seconds
