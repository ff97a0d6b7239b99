"""The model of meshtron's own step memory (:mod:`meshtron.plan.step_memory`): its parameter counts equal
the built models', its terms follow the settings they model, and its XLA:CPU figures agree with
compiled steps of real models (Llama-2 7B, 13B, 70B, Llama-3 8B, the paper's GPT 3.6B) within 10%."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import subprocess_env

from meshtron.config import load_config
from meshtron.errors import ConfigError
from meshtron.mesh import AXES, mesh_shape
from meshtron.plan.step_memory import StepRun, StepShape, block_parameters, other_parameters, step_memory
from meshtron.run import resolve_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("config, overrides", [
    ("cpu8", []),
    ("llama_cpu8", []),
    ("llama_cpu8", ["model.kv_heads=2", "parallel.data=2", "parallel.pipe=1", "parallel.tensor=4"]),  # kv heads split
    ("llama_cpu8", ["model.kv_heads=1", "parallel.data=2", "parallel.pipe=1", "parallel.tensor=4"]),  # kv heads whole
])
def test_parameter_counts_equal_the_built_models(config, overrides):
    from meshtron.describe import parameter_rows
    from meshtron.train.state import model_def_from_config

    cfg = load_config(config, overrides)
    sizes = dict(zip(AXES, mesh_shape(cfg.mesh)))
    rows = parameter_rows(model_def_from_config(cfg.model, sizes["tensor"]), sizes)
    shape = StepShape.from_config(cfg.model)
    blocks = sum(r[4] for r in rows if r[0].startswith("blocks/"))
    rest = sum(r[4] for r in rows) - blocks
    assert blocks == block_parameters(shape, sizes["tensor"]) * 4 * cfg.model.layers // sizes["pipe"]
    assert rest == other_parameters(shape, sizes["tensor"]) * 4


def _memory(config: str, overrides: list[str], backend: str = "cpu"):
    cfg = load_config(config, overrides)
    run = resolve_run(cfg, cfg.mesh.data * cfg.mesh.pipe * cfg.mesh.tensor)
    return step_memory(StepShape.from_config(run.cfg.model), StepRun.from_config(run.cfg, run.program), backend)


def test_zero_levels_split_what_they_say():
    mesh = ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=8", "parallel.sequence_parallel=true"]
    z0, z1, z3 = (_memory("llama2_7b", [*mesh, f"parallel.zero={z}"]) for z in (0, 1, 3))
    assert z1.optimizer == pytest.approx(z0.optimizer / 8) and z1.parameters == z0.parameters
    assert z3.parameters == pytest.approx(z0.parameters / 8) and z3.optimizer == z1.optimizer
    assert z1.gradients == z0.gradients == pytest.approx(2 * z0.parameters)  # accumulator + a microbatch's
    assert z3.gradients < z0.gradients / 4  # the device's share, one layer in flight
    once = _memory("llama2_70b", ["parallel.gather_once=true"])
    per_layer = _memory("llama2_70b", ["parallel.gather_once=false"])
    assert once.gradients == pytest.approx(3 * once.parameters * 2)  # gathered stage + whole gradients, twice
    assert per_layer.gradients < once.gradients / 2


def test_backends_differ_only_where_their_buffer_assignments_do():
    cpu, gpu = (_memory("llama2_7b", [], backend) for backend in ("cpu", "gpu"))
    same = ("parameters", "optimizer", "gradients", "logits")
    assert all(getattr(cpu, name) == getattr(gpu, name) for name in same)
    assert cpu.stash > gpu.stash  # the recomputed chunk's layer inputs, bf16 and fp32 on the CPU
    # 7B 8x4x2: [b=2, heads/t=16, 4096, 4096] scores; XLA:CPU four fp32 arrays, XLA:GPU two fp32 and two bf16
    scores = 2 * 16 * 4096 * 4096
    assert cpu.working == 4 * 4 * scores and gpu.working == (2 * 4 + 2 * 2) * scores
    fused = _memory("llama2_7b", ["model.attention=cudnn"], "gpu")
    assert fused.working < gpu.working / 4  # no [s, s] scores: the layer's recomputed residuals remain
    split = _memory("llama2_7b", ["parallel.schedule=zb-h1"], "gpu")
    assert split.weight_buffers > 0 and split.layers_kept > 0 and gpu.weight_buffers == 0
    # each B-to-W buffer's token on a layer: the projections' bf16 output cotangents -- attention out and
    # down 4096 each, qkv 3·2048, gate/up 2·5504 (W recomputes their inputs from the stashed stage input)
    slots = resolve_run(load_config("llama2_7b", ["parallel.schedule=zb-h1"]), 64).program.weight_slots
    per_token = (2 * 4096 + 3 * 2048 + 2 * 5504) * 2
    assert split.weight_buffers == slots * 8 * 2 * 4096 * per_token == pytest.approx(13.3e9, rel=0.01)
    assert split.weight_buffers == _memory("llama2_7b", ["parallel.schedule=zb-h1"], "cpu").weight_buffers


def test_sequence_parallelism_and_recomputation_shrink_what_they_should():
    base = ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=8", "parallel.zero=1"]
    full, sp = _memory("llama2_7b", base), _memory("llama2_7b", [*base, "parallel.sequence_parallel=true"])
    assert sp.stash == pytest.approx(full.stash / 8)
    selective = _memory("llama2_7b", [*base, "parallel.sequence_parallel=true", "model.remat=selective"])
    none = _memory("llama2_7b", [*base, "parallel.sequence_parallel=true", "model.remat=none"])
    assert sp.layers_kept == 0 < selective.layers_kept < none.layers_kept


def test_kept_residuals_under_full_recomputation_are_the_layer_inputs():
    # llama2_7b: 8x4x2 1F1B, 8 layers per stage, microbatch 2 x 4096 tokens, hidden 4096, bf16.
    stage_input = _memory("llama2_7b", [], "gpu")
    layer_inputs = _memory("llama2_7b", ["parallel.recompute=false"], "gpu")
    residuals = _memory("llama2_7b", ["parallel.recompute=false", "model.remat=none"], "gpu")
    slots = resolve_run(load_config("llama2_7b", ["parallel.recompute=false"]), 64).program.residual_slots
    assert layer_inputs.layers_kept == slots * (8 + 1) * 2 * 4096 * 4096 * 2  # 8 layer inputs + the chunk output
    assert stage_input.layers_kept == 0 < layer_inputs.layers_kept < residuals.layers_kept / 10
    assert layer_inputs.working == stage_input.working  # one layer recomputed at a time, either way


def test_each_context_exchange_holds_the_scores_it_attends_at_once():
    """The attention backward's working set (XLA's attention) is one score array per device: gathered's
    s/c queries against every key and Ulysses's whole sequence for a c-th of the heads are as many elements;
    the ring's s/c x s/c block is c times fewer, the hybrid's u times the ring's (one block of a group's
    tokens for a u-th of the heads). cuDNN's fused attention holds none, whichever exchange."""
    from meshtron.plan.step_memory import score_elements

    shape = StepShape.from_config(load_config("llama2_7b", ["model.seq_len=32768", "model.max_position_embeddings=32768"]).model)
    c, t, u = 8, 1, 2

    def run(exchange: str, attention: str = "xla", **more) -> StepRun:
        return StepRun(data=1, pipe=1, tensor=t, microbatch=1, context=c, context_attention=exchange,
                       ulysses_degree=u if exchange == "hybrid" else 1, attention=attention, **more)

    def working(exchange: str, attention: str = "xla") -> float:
        return step_memory(shape, run(exchange, attention, remat="none"), "gpu").working

    whole = 32 * 32768 * 32768
    elements = {exchange: score_elements(shape, run(exchange)) for exchange in ("gathered", "ring", "ulysses", "hybrid")}
    assert elements == {"gathered": whole / c, "ulysses": whole / c, "ring": whole / c**2, "hybrid": u * whole / c**2}
    assert working("ulysses") == working("gathered") == c * working("ring") == c / u * working("hybrid") > 0
    assert {working(exchange, "cudnn") for exchange in elements} == {0.0}
    assert score_elements(shape, dataclasses.replace(run("ulysses"), context=1)) == whole  # one rank: no split


def test_bad_inputs_get_one_line():
    shape = StepShape.from_config(load_config("cpu8").model)
    with pytest.raises(ConfigError, match="^backend: must be one of gpu, cpu, got 'tpu'$"):
        step_memory(shape, StepRun(data=1, pipe=1, tensor=1, microbatch=1), "tpu")
    model = dataclasses.replace(load_config("cpu8").model, factory="mypkg.models:build")
    with pytest.raises(ConfigError, match="^model.family: the step memory model counts the built-in gpt and llama"):
        StepShape.from_config(model)


COMPILE = """
import json, os, sys
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=64"
target = sys.argv[2] if len(sys.argv) > 2 else None  # a compile-only GPU target, or the simulated CPUs
if target:
    from meshtron.gpu.targets import prepare_environment
    prepare_environment()
import jax
from meshtron.config import load_config
from meshtron.describe import modelled_step_memory, parameter_rows
from meshtron.mesh import AXES
from meshtron.train.loop import Trainer
out = []
for config, overrides in json.loads(sys.argv[1]):
    cfg = load_config(config, overrides)
    if target:
        trainer = Trainer.from_config(cfg, target=target, read_data=False)
    else:
        trainer = Trainer.from_config(cfg, jax.devices()[: cfg.mesh.data * cfg.mesh.pipe * cfg.mesh.tensor], read_data=False)
    program = trainer.steps.compile(*trainer.abstract_step_arguments())
    memory = program.memory_analysis()
    rows = parameter_rows(trainer.model_def, dict(zip(AXES, trainer.resolved.mesh_shape)))
    model = modelled_step_memory(trainer.resolved, rows, "gpu" if target else "cpu")
    out.append([config, overrides, memory.argument_size_in_bytes + memory.temp_size_in_bytes, model.peak])
print(json.dumps(out))
"""

REAL = {  # the bundled real-size configs on their own meshes, and the paper's GPT without a pipeline
    "representative": [  # the CI tier's: 1F1B, zero=3 without a pipeline, tensor split, zb-h1, LoRA's frozen base
        ("llama2_7b", []),  # 8x4x2 1F1B
        ("llama3_8b", []),  # 8x1x1, 8192 tokens, 128K vocabulary, zero=3
        ("paper/gpt_3_6b", ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=8"]),
        ("llama2_7b", ["parallel.schedule=zb-h1"]),  # B's residuals and the B-to-W buffers
        ("llama2_7b", ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=8", "parallel.sequence_parallel=true",
                       "train.lora.rank=16", "parallel.zero=3"]),  # LoRA, its frozen base split over data
    ],
    "extended": [  # further configurations of the same claim (make test runs them)
        ("llama2_13b", []),  # 8x4x2 1F1B, zero=1
        ("llama2_7b", ["parallel.data=2", "parallel.pipe=4", "parallel.tensor=8", "parallel.sequence_parallel=true",
                       "parallel.zero=1", "parallel.microbatches=64"]),
        ("llama2_7b", ["parallel.recompute=false"]),  # full recomputation from each layer's kept input
        ("llama2_7b", ["train.lora.rank=16"]),  # LoRA: gradients and optimizer state of the adapters alone
        ("llama2_7b", ["train.objective=dpo", "train.batch_size=256"]),  # DPO: a frozen copy of the weights, an argument
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("group", ["representative", pytest.param("extended", marks=pytest.mark.extended)])
def test_the_model_agrees_with_compiled_steps_of_real_models_within_ten_percent(group):
    """Compiled from abstract arrays on 64 simulated devices (nothing allocated); with the two configs
    ``tests/test_cli.py`` compiles through ``describe --compile`` (7B on 8x1x8, 70B on 2x4x8 zero=3),
    eleven real configurations."""
    env = subprocess_env()
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(REAL[group])], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    for config, overrides, compiled, modelled in json.loads(run.stdout.splitlines()[-1]):
        assert abs(modelled / compiled - 1) <= 0.10, (config, overrides, compiled / 1e9, modelled / 1e9)


GPU_REAL = {  # Llama-2 7B compiled for compile-only H100s: XLA attention without a pipeline and 1F1B on 4 stages
    "representative": [  # the CI tier's: a pipeline with XLA's attention, cuDNN's without one
        ("llama2_7b", ["parallel.zero=1", "model.attention=xla"]),  # 8x4x2 1F1B
        # cuDNN's fused attention (no [s, s] buffers): 11.6 GB compiled, 11.9 modelled
        ("llama2_7b", ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=8", "parallel.sequence_parallel=true",
                       "parallel.zero=1", "model.attention=cudnn"]),
    ],
    "extended": [  # XLA's attention without a pipeline (make test runs it)
        ("llama2_7b", ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=8", "parallel.sequence_parallel=true",
                       "parallel.zero=1", "model.attention=xla"]),
    ],
}


@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.parametrize("group", ["representative", pytest.param("extended", marks=pytest.mark.extended)])
def test_the_gpu_model_agrees_with_xla_gpu_compiled_steps_within_ten_percent(group):
    """XLA:GPU's buffer assignment for 64 compile-only H100s (JAX's CUDA plugin, no GPU): the ``gpu``
    backend's peak within 10% of it (``benchmarks/memory_at_scale.py --compilers h100`` checks 21)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for H100s needs JAX's CUDA plugin (the gpu-compile extra)")
    env = subprocess_env()
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(GPU_REAL[group]), "h100"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    for config, overrides, compiled, modelled in json.loads(run.stdout.splitlines()[-1]):
        assert abs(modelled / compiled - 1) <= 0.10, (config, overrides, compiled / 1e9, modelled / 1e9)


def test_the_planner_prices_meshtrons_step_on_its_layouts():
    from meshtron.plan import Layout, ModelShape, load_cluster, make_plan
    from meshtron.plan.step_memory import layout_step_memory

    model = ModelShape.from_config(load_config("paper/gpt_145_6b").model)
    layout = Layout(8, 8, 24, 1, 2304, 1, "full")
    memory = layout_step_memory(model, layout)
    tokens_h = 1 * 2048 * 12288  # b·s·h
    # meshtron's 1F1B program on 8 stages stashes up to 13 stage inputs (what a stage receives waits in its stash
    # until its forward) and the recomputed chunk's 10 layer inputs, bf16
    assert memory.stash == (13 + 10) * tokens_h * 2
    assert memory.working < memory.stash and memory.weight_buffers == 0  # cuDNN: no [s, s] scores
    assert layout_step_memory(model, layout, schedule="zb-h1").weight_buffers > 0
    assert layout_step_memory(model, Layout(8, 16, 144, 2, 2304, 1, "full")) is None  # m = 8 < p = 16: no table
    plan = make_plan(model, 1536, 2304, load_cluster("a100-80gb")).to_dict(top=3)
    assert all(row["meshtron_memory_gb"] > 0 for row in plan["ranked"])


DEEPSEEK_SMALL = ["model.family=deepseek", "model.kv_heads=null", "model.moe.experts=0", "model.mla.q_lora_rank=64",
                  "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=1",
                  "train.batch_size=8"]
DEEPSEEK_CASES = [  # the small DeepSeek of mixtral_cpu8's shape with dense blocks, on one device
    ("mixtral_cpu8", DEEPSEEK_SMALL),  # remat none: latent attention's own widths
    ("mixtral_cpu8", [*DEEPSEEK_SMALL, "model.mtp.layers=2"]),  # two modules' blocks and logits
    ("mixtral_cpu8", [*DEEPSEEK_SMALL, "model.mtp.layers=1", "model.remat=selective"]),
    ("mixtral_cpu8", [*DEEPSEEK_SMALL, "model.mtp.layers=1", "model.remat=full"]),
    ("mixtral_cpu8", [*DEEPSEEK_SMALL, "parallel.pipe=2", "parallel.tensor=2", "parallel.microbatches=2"]),
]


@pytest.mark.slow
def test_the_model_agrees_with_compiled_steps_of_a_small_deepseek_within_ten_percent():
    """Latent attention's residuals (:func:`meshtron.models.deepseek_counts.block_activations`) and the
    multi-token prediction modules' (:class:`StepMemory`'s ``mtp``), held to XLA:CPU's compiled steps."""
    env = subprocess_env()
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(DEEPSEEK_CASES)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    for config, overrides, compiled, modelled in json.loads(run.stdout.splitlines()[-1]):
        assert abs(modelled / compiled - 1) <= 0.10, (overrides, compiled / 2**20, modelled / 2**20)
