"""The GEMM census of optimized HLO (kernel, operand element types, FLOPs, executions) and the
step-time estimate's pricing of float8 GEMMs at the target's FP8 peak: handwritten programs in the
shapes XLA:GPU emits, an XLA:CPU program compiled here, and a float8 matmul with its gradient
compiled for an H100."""

from __future__ import annotations

import pytest

from meshtron.errors import ConfigError
from meshtron.gpu.step_time import DEFAULT_GEMM_EFFICIENCY, estimate_step, flop_floor_seconds
from meshtron.gpu.targets import TARGETS
from meshtron.hlo.gemms import GemmTotals, gemm_flops, gemms, is_f8, kernels_of, totals_by_operand_types
from meshtron.plan.cluster import load_cluster

# The three GEMMs of a float8 matmul's forward and backward, as XLA:GPU emits them for an H100: the
# forward as cuBLASLt's float8 GEMM (operands, then their two scales), the backward's two as Triton
# fusions of float8 dots (e5m2 gradient times an e4m3 operand) -- in a loop of 4 -- and one bf16 GEMM
# whose Triton fusion reads a float8 parameter but converts it first, so the tensor cores multiply bf16.
_F8_GEMM = ('custom_call_target="__cublas$lt$matmul$f8", backend_config={"operation_queue_id":"0",'
            '"gemm_backend_config":{"selected_algorithm":"0","alpha_real":1,"beta":0,"dot_dimension_numbers":'
            '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],'
            '"rhs_batch_dimensions":[]},"epilogue":"DEFAULT","scale_mode":1}}')
_TRITON = ('backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion",'
           '"block_level_fusion_config":{"num_warps":"2","output_tiles":[{"sizes":["16","8"]}]}}}')

PROGRAM = f"""HloModule jit_f8, is_scheduled=true

%grad_x (p0: f8e5m2[256,512], p1: f8e4m3fn[128,512], s: f32[]) -> bf16[256,128] {{
  %p0 = f8e5m2[256,512]{{1,0}} parameter(0)
  %p1 = f8e4m3fn[128,512]{{1,0}} parameter(1)
  %dx = bf16[256,128]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}, metadata={{op_name="jit(step)/transpose(jvp(block))/dot_general"}}
  %s = f32[] parameter(2)
  %sb = bf16[] convert(%s)
  %b = bf16[256,128]{{1,0}} broadcast(%sb), dimensions={{}}
  ROOT %scaled = bf16[256,128]{{1,0}} multiply(%dx, %b)
}}

%grad_w (q0: f8e4m3fn[256,128], q1: f8e5m2[256,512]) -> bf16[128,512] {{
  %q0 = f8e4m3fn[256,128]{{1,0}} parameter(0)
  %q1 = f8e5m2[256,512]{{1,0}} parameter(1)
  ROOT %dw = bf16[128,512]{{1,0}} dot(%q0, %q1), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
}}

%upcast_gemm (r0: f8e4m3fn[256,128], r1: bf16[128,64]) -> bf16[256,64] {{
  %r0 = f8e4m3fn[256,128]{{1,0}} parameter(0)
  %wide = bf16[256,128]{{1,0}} convert(%r0)
  %r1 = bf16[128,64]{{1,0}} parameter(1)
  ROOT %d = bf16[256,64]{{1,0}} dot(%wide, %r1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%body (state: (s32[], f8e5m2[256,512], f8e4m3fn[128,512], f8e4m3fn[256,128])) -> (s32[], f8e5m2[256,512], f8e4m3fn[128,512], f8e4m3fn[256,128]) {{
  %state = (s32[], f8e5m2[256,512]{{1,0}}, f8e4m3fn[128,512]{{1,0}}, f8e4m3fn[256,128]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %g = f8e5m2[256,512]{{1,0}} get-tuple-element(%state), index=1
  %w = f8e4m3fn[128,512]{{1,0}} get-tuple-element(%state), index=2
  %x = f8e4m3fn[256,128]{{1,0}} get-tuple-element(%state), index=3
  %one_f = f32[] constant(1)
  %gx = bf16[256,128]{{1,0}} fusion(%g, %w, %one_f), kind=kCustom, calls=%grad_x, {_TRITON}
  %gw = bf16[128,512]{{1,0}} fusion(%x, %g), kind=kCustom, calls=%grad_w, metadata={{op_name="jit(step)/head/dot_general"}}, {_TRITON}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f8e5m2[256,512]{{1,0}}, f8e4m3fn[128,512]{{1,0}}, f8e4m3fn[256,128]{{1,0}}) tuple(%next, %g, %w, %x)
}}

%cond (cstate: (s32[], f8e5m2[256,512], f8e4m3fn[128,512], f8e4m3fn[256,128])) -> pred[] {{
  %cstate = (s32[], f8e5m2[256,512]{{1,0}}, f8e4m3fn[128,512]{{1,0}}, f8e4m3fn[256,128]{{1,0}}) parameter(0)
  %ci = s32[] get-tuple-element(%cstate), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %four), direction=LT
}}

ENTRY %main (x: f8e4m3fn[256,128], w: f8e4m3fn[128,512], g: f8e5m2[256,512], v: bf16[128,64]) -> bf16[256,64] {{
  %x = f8e4m3fn[256,128]{{1,0}} parameter(0)
  %w = f8e4m3fn[128,512]{{1,0}} parameter(1)
  %g = f8e5m2[256,512]{{1,0}} parameter(2)
  %v = bf16[128,64]{{1,0}} parameter(3)
  %sx = f32[] constant(1)
  %wt = f8e4m3fn[512,128]{{1,0}} transpose(%w), dimensions={{1,0}}
  %gemm = (bf16[256,512]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %wt, %sx, %sx), metadata={{op_name="jit(step)/block/dot_general"}}, {_F8_GEMM}
  %y = bf16[256,512]{{1,0}} get-tuple-element(%gemm), index=0
  %zero = s32[] constant(0)
  %init = (s32[], f8e5m2[256,512]{{1,0}}, f8e4m3fn[128,512]{{1,0}}, f8e4m3fn[256,128]{{1,0}}) tuple(%zero, %g, %w, %x)
  %loop = (s32[], f8e5m2[256,512]{{1,0}}, f8e4m3fn[128,512]{{1,0}}, f8e4m3fn[256,128]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"4"}}}}
  ROOT %z = bf16[256,64]{{1,0}} fusion(%x, %v), kind=kCustom, calls=%upcast_gemm, {_TRITON}
}}
"""

_FWD = 2 * 256 * 512 * 128  # [256,128] x [128,512]
_GRAD_X = 2 * 256 * 128 * 512
_GRAD_W = 2 * 128 * 512 * 256
_UPCAST = 2 * 256 * 64 * 128
E4, E5 = "f8e4m3fn", "f8e5m2"


def test_each_gemm_has_its_kernel_operand_types_flops_and_executions():
    found = {g.instruction: g for g in gemms(PROGRAM)}
    assert set(found) == {"gemm", "gx", "gw", "z"}
    forward, grad_x, grad_w, upcast = found["gemm"], found["gx"], found["gw"], found["z"]
    assert (forward.kernel, forward.lhs, forward.rhs, forward.output) == ("__cublas$lt$matmul$f8", E4, E4, "bf16")
    assert (forward.flops, forward.count, forward.computation) == (_FWD, 1, "main")
    assert (grad_x.kernel, grad_x.lhs, grad_x.rhs) == ("__triton_nested_gemm_fusion", E5, E4)
    assert (grad_w.lhs, grad_w.rhs) == (E4, E5)
    assert (grad_x.flops, grad_x.count, grad_w.flops, grad_w.count) == (_GRAD_X, 4, _GRAD_W, 4)
    assert forward.f8 and grad_x.f8 and grad_w.f8
    # the fused convert makes it a bf16 GEMM though the fusion reads a float8 array
    assert (upcast.lhs, upcast.rhs, upcast.f8, upcast.flops) == ("bf16", "bf16", False, _UPCAST)
    # the name stack: the dot's own inside a fusion, else the launching instruction's
    assert [found[n].op_name for n in ("gemm", "gx", "gw", "z")] == [
        "jit(step)/block/dot_general", "jit(step)/transpose(jvp(block))/dot_general", "jit(step)/head/dot_general", ""]


def test_gemms_grouped_by_operand_types_count_instructions_executions_and_flops():
    found = gemms(PROGRAM)
    assert totals_by_operand_types(found) == {
        (E4, E4): GemmTotals(1, 1, _FWD),
        (E5, E4): GemmTotals(1, 4, 4 * _GRAD_X),
        (E4, E5): GemmTotals(1, 4, 4 * _GRAD_W),
        ("bf16", "bf16"): GemmTotals(1, 1, _UPCAST),
    }
    assert kernels_of(found) == {"__cublas$lt$matmul$f8": 1, "__triton_nested_gemm_fusion": 3}
    assert gemm_flops(PROGRAM) == _FWD + 4 * (_GRAD_X + _GRAD_W) + _UPCAST


def test_is_f8_names_the_eight_bit_floats_only():
    assert all(is_f8(t) for t in ("f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3"))
    assert not any(is_f8(t) for t in ("bf16", "f16", "f32", "s8", "u8"))


def test_float8_gemms_are_priced_at_the_fp8_peak_and_the_rest_at_the_bf16_peak():
    efficiency = 0.5
    h100 = load_cluster("h100-80gb")
    fp8_peak = TARGETS["h100"].fp8_peak_tflops
    assert (fp8_peak, h100.peak_tflops) == (1979.0, 989)
    estimate = estimate_step(PROGRAM, {"data": 1}, "h100", tokens_per_step=256, model_flops_per_step=1e9,
                             gemm_efficiency=efficiency)
    f8 = _FWD + 4 * (_GRAD_X + _GRAD_W)
    assert estimate.f8_gemm_flops == f8
    assert estimate.gemm_flops == f8 + _UPCAST
    assert estimate.compute_seconds == pytest.approx(f8 / (fp8_peak * 1e12 * efficiency)
                                                     + _UPCAST / (h100.peak_tflops * 1e12 * efficiency))
    # MFU: vs the bf16 peak (comparable with a bf16 program's) and vs the FP8 peak
    assert estimate.mfu == pytest.approx(1e9 / (estimate.seconds * h100.peak_tflops * 1e12))
    assert estimate.mfu_fp8_peak == pytest.approx(1e9 / (estimate.seconds * fp8_peak * 1e12))
    assert any("FP8 peak" in line for line in estimate.lines())


def test_a_float8_gemm_takes_half_the_time_of_the_same_bf16_gemm():
    bf16 = PROGRAM.replace("f8e4m3fn", "bf16").replace("f8e5m2", "bf16").replace("$lt$matmul$f8", "$lt$matmul")
    f8 = estimate_step(PROGRAM, {"data": 1}, "h100", tokens_per_step=1, model_flops_per_step=1.0)
    wide = estimate_step(bf16, {"data": 1}, "h100", tokens_per_step=1, model_flops_per_step=1.0)
    assert wide.gemm_flops == f8.gemm_flops and wide.f8_gemm_flops == 0
    upcast = _UPCAST / (989e12 * DEFAULT_GEMM_EFFICIENCY)  # bf16 in both programs
    assert (f8.compute_seconds - upcast) / (wide.compute_seconds - upcast) == pytest.approx(989 / 1979)


def test_a_float8_gemm_on_a_gpu_without_fp8_is_one_config_error():
    assert TARGETS["a100"].fp8_peak_tflops is None
    with pytest.raises(ConfigError, match=r"target 'a100': the program runs float8 GEMMs \(gemm\).*no FP8"):
        estimate_step(PROGRAM, {"data": 1}, "a100", tokens_per_step=1, model_flops_per_step=1.0)


def test_the_fp8_flop_floor_is_half_the_bf16_one_and_needs_fp8_tensor_cores():
    bf16 = flop_floor_seconds("h100", 8, model_flops_per_step=1e15)
    assert flop_floor_seconds("h100", 8, model_flops_per_step=1e15, fp8=True) == pytest.approx(bf16 * 989 / 1979)
    with pytest.raises(ConfigError, match="target 'a100': no FP8 tensor cores"):
        flop_floor_seconds("a100", 8, model_flops_per_step=1e15, fp8=True)


def test_xla_cpu_upcasts_float8_operands_before_its_gemm():
    """XLA:CPU has no float8 GEMM: it converts the operands first (to f32 in jaxlib 0.10, bf16 in 0.12),
    and the census reports the types the GEMM multiplies."""
    import jax
    import jax.numpy as jnp

    def f(x, w):
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)

    x = jax.ShapeDtypeStruct((32, 64), jnp.float8_e5m2)
    w = jax.ShapeDtypeStruct((64, 16), jnp.float8_e4m3fn)
    text = jax.jit(f).lower(x, w).compile().as_text()
    (gemm,) = gemms(text)
    assert gemm.lhs == gemm.rhs and gemm.lhs in ("f32", "bf16")
    assert (gemm.f8, gemm.flops) == (False, 2 * 32 * 16 * 64)


# --------------------------------------------------------------------------------------------------
# Compiled for an H100
# --------------------------------------------------------------------------------------------------


def _f8_matmul_and_grad(gpu_target: str, fp8: bool) -> str:
    """A matmul and both its gradients, through Flax's scaled float8 dot (float8 GEMMs) or a plain bf16
    dot, compiled for one ``gpu_target`` GPU."""
    import jax
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    from meshtron.gpu.targets import target_devices

    device = target_devices(gpu_target, 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    numbers = (((1,), (0,)), ((), ()))

    def matmul(x, w, scale, history):
        with jax.named_scope("block"):
            return projection(x, w, scale, history)

    def projection(x, w, scale, history):
        if not fp8:
            return jax.lax.dot_general(x, w, numbers)
        return fp8_ops.fp8_scaled_dot_general(
            x, w, numbers, preferred_element_type=jnp.bfloat16, lhs_scale=scale, rhs_scale=scale,
            grad_scale=scale, lhs_amax_history=history, rhs_amax_history=history, grad_amax_history=history)

    def step(x, w, cotangent, scale, history):
        y, pull = jax.vjp(lambda x, w: matmul(x, w, scale, history), x, w)
        return y, pull(cotangent)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    arguments = (spec((512, 1024), jnp.bfloat16), spec((1024, 2048), jnp.bfloat16), spec((512, 2048), jnp.bfloat16),
                 spec((), jnp.float32), spec((16,), jnp.float32))
    return jax.jit(step).lower(*arguments).compile().as_text()


@pytest.mark.gpu_compile
def test_a_float8_matmul_and_its_gradient_compile_to_float8_gemms_at_the_fp8_peak(gpu_target):
    text = _f8_matmul_and_grad(gpu_target, fp8=True)
    found = gemms(text)
    forward, backward = 2 * 512 * 2048 * 1024, 2 * 2 * 512 * 2048 * 1024
    assert len(found) == 3 and all(g.f8 and "block" in g.op_name for g in found)
    # forward e4m3 x e4m3; the two backward GEMMs multiply the e5m2 gradient by an e4m3 operand
    types = {types: totals.instructions for types, totals in totals_by_operand_types(found).items()}
    assert types[(E4, E4)] == 1 and sum(n for t, n in types.items() if set(t) == {E4, E5}) == 2
    assert gemm_flops(text) == forward + backward
    bf16 = _f8_matmul_and_grad(gpu_target, fp8=False)
    assert not any(g.f8 for g in gemms(bf16)) and gemm_flops(bf16) == forward + backward
    f8_estimate = estimate_step(text, {"data": 1}, gpu_target, tokens_per_step=512, model_flops_per_step=1.0)
    bf16_estimate = estimate_step(bf16, {"data": 1}, gpu_target, tokens_per_step=512, model_flops_per_step=1.0)
    assert f8_estimate.f8_gemm_flops == forward + backward
    assert f8_estimate.compute_seconds == pytest.approx(bf16_estimate.compute_seconds * 989 / 1979)
