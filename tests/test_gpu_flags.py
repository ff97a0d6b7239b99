"""Windowed einsum (collective matmul) programs as the step-time estimate reads them: computations
XLA runs on another thread, GEMMs on their own streams beside collectives, and a program XLA:GPU
compiled with ``--xla_gpu_threshold_for_windowed_einsum_mib=0``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from subprocess_env import subprocess_env

from meshtron.gpu.step_time import estimate_step, gemm_flops
from meshtron.hlo.schedule import collective_windows
from meshtron.hlo.text import parse_hlo_module

SIZES = {"data": 1, "tensor": 8}
_GEMM_CALL = "calls=%gemm, backend_config={{\"operation_queue_id\":\"{queue}\"}}"
_PERMUTE = ('source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}, '
            'backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":true}}')


def _program(body: str) -> str:
    return f"""HloModule jit_step, is_scheduled=true

%gemm (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {{
  %p0 = bf16[4096,4096]{{1,0}} parameter(0)
  %p1 = bf16[4096,4096]{{1,0}} parameter(1)
  ROOT %dot.1 = bf16[4096,4096]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}, execution_thread="parallel"

ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096], x: bf16[16384,4096]) -> (bf16[4096,4096], bf16[16384,4096]) {{
  %a = bf16[4096,4096]{{1,0}} parameter(0)
  %b = bf16[4096,4096]{{1,0}} parameter(1)
  %x = bf16[16384,4096]{{1,0}} parameter(2)
{body}
}}
"""


def _side_gemm_beside_a_permute(queue: int) -> str:
    """A GEMM started on stream ``queue``, a synchronous collective-permute, then the GEMM's done."""
    return _program(f"""  %fusion-start = ((bf16[4096,4096]{{1,0}}, bf16[4096,4096]{{1,0}}), bf16[4096,4096]{{1,0}}) fusion-start(%a, %b), kind=kCustom, {_GEMM_CALL.format(queue=queue)}
  %collective-permute = bf16[16384,4096]{{1,0}} collective-permute(%x), channel_id=1, {_PERMUTE}
  %fusion-done = bf16[4096,4096]{{1,0}} fusion-done(%fusion-start)
  ROOT %out = (bf16[4096,4096]{{1,0}}, bf16[16384,4096]{{1,0}}) tuple(%fusion-done, %collective-permute)""")


GEMM_ONLY = _program("""  %fusion = bf16[4096,4096]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
  ROOT %out = (bf16[4096,4096]{1,0}, bf16[16384,4096]{1,0}) tuple(%fusion, %x)""")
PERMUTE_ONLY = _program(f"""  %collective-permute = bf16[16384,4096]{{1,0}} collective-permute(%x), channel_id=1, {_PERMUTE}
  ROOT %out = (bf16[4096,4096]{{1,0}}, bf16[16384,4096]{{1,0}}) tuple(%a, %collective-permute)""")


def _estimate(text: str):
    return estimate_step(text, SIZES, "h100", tokens_per_step=1, model_flops_per_step=1.0)


def test_a_computation_closed_with_its_execution_thread_ends_there():
    module = parse_hlo_module(_side_gemm_beside_a_permute(14))
    assert [i.name for i in module.computations["gemm"].instructions] == ["p0", "p1", "dot.1"]
    assert module.entry == "main" and module.computations["main"].instructions[3].opcode == "fusion-start"
    assert gemm_flops(module) == 2 * 4096**3


def test_a_gemm_on_its_own_stream_hides_a_synchronous_permute_beside_it():
    gemm, permute = _estimate(GEMM_ONLY).seconds, _estimate(PERMUTE_ONLY).communication_seconds
    assert 0 < gemm < permute  # the permute (128 MiB to the next rank) outlasts the GEMM: part stays exposed
    side, serial = _estimate(_side_gemm_beside_a_permute(14)), _estimate(_side_gemm_beside_a_permute(0))
    assert side.seconds == pytest.approx(permute)
    assert side.exposed_communication_seconds == pytest.approx(permute - gemm)
    assert side.compute_seconds == pytest.approx(gemm)
    # queue 0 is the compute stream: the async fusion runs there, then the permute waits its turn
    assert serial.seconds == pytest.approx(gemm + permute)
    assert serial.exposed_communication_seconds == pytest.approx(permute)


_CHILD = """
import sys
from meshtron.gpu.targets import prepare_environment, target_devices
prepare_environment()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(target_devices("h100", 8)).reshape(2, 4), ("data", "tensor"))
S = lambda *spec: NamedSharding(mesh, P(*spec))
def layer(x, w1, w2):  # sequence-parallel input -> column-parallel -> row-parallel -> sequence-parallel
    h = jax.lax.with_sharding_constraint(x @ w1, S("data", None, "tensor"))
    return jax.lax.with_sharding_constraint(jax.nn.relu(h) @ w2, S("data", "tensor", None))
def layers(x, w1, w2):  # two layers in a scan, as meshtron runs its blocks
    return jax.lax.scan(lambda h, w: (layer(h, *w), None), x, (w1, w2))[0]
args = (jax.ShapeDtypeStruct((4, 2048, 1024), jnp.bfloat16, sharding=S("data", "tensor", None)),
        jax.ShapeDtypeStruct((2, 1024, 4096), jnp.bfloat16, sharding=S(None, None, "tensor")),
        jax.ShapeDtypeStruct((2, 4096, 1024), jnp.bfloat16, sharding=S(None, "tensor", None)))
step = jax.grad(lambda *a: layers(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
open(sys.argv[1], "w").write(jax.jit(step).lower(*args).compile().as_text())
"""


def _compiled(tmp_path, flags: str) -> str:
    path = tmp_path / f"program{len(flags)}.hlo"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], check=False, env=subprocess_env(flags),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return path.read_text()


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_windowed_einsum_turns_the_sequence_parallel_collectives_into_permutes_the_estimate_counts(gpu_target, tmp_path):
    plain = _compiled(tmp_path, "")
    windowed = _compiled(tmp_path, "--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                                   "--xla_gpu_multi_streamed_windowed_einsum=true")
    sizes = {"data": 2, "tensor": 4}

    def tensor_kinds(text):
        return {w.kind for w in collective_windows(text, sizes) if w.collective.axes == ("tensor",)}

    assert "collective-permute" not in tensor_kinds(plain)
    assert "collective-permute" in tensor_kinds(windowed)
    module = parse_hlo_module(windowed)
    assert any(name.startswith("unrolled_windowed_dot_general_body") for name in module.computations)
    side_gemms = [i for c in module.computations.values() for i in c.instructions
                  if i.opcode == "fusion-start" and '"operation_queue_id":"0"' not in i.attributes]
    assert side_gemms  # the loops' GEMMs run on their own streams
    # the same GEMMs in both programs: the unrolled loops' computations (closed with their execution
    # thread) are read whole, so none of their GEMMs is lost
    per_dot = 2 * 4 * 2048 * 1024 * 4096 / 8  # one projection of one layer on one of the 8 GPUs
    assert gemm_flops(windowed) == gemm_flops(plain) == 2 * 6 * per_dot  # two layers, two dots forward, four backward
