"""Everything that compiles for the CPU compiles for an H100: each feature's program, compiled by
XLA's GPU compiler for 8 compile-only H100s (:mod:`meshtron.gpu.targets`), with the properties of a
GPU program asserted on its optimized HLO.

One compile per feature, features combined where they do not hide each other: every pipeline
schedule (gpipe, 1f1b, interleaved, 1f1b-p, zb-h1, an uneven ``parallel.layout``), tensor,
sequence and context parallelism (both context exchanges), ZeRO 0/1/3 and gather-once, experts
split over data, LoRA, packed documents, 1-bit LAMB's two stages, the evaluation program and the
generation program. Small models (hidden 64, 2-4 layers, 64 tokens): what is checked is that the
program exists and talks over the right mesh axes, not its speed.

What makes the program XLA:GPU's: the scheduled module (``is_scheduled=true``, the latency-hiding
scheduler's output), matmuls as Triton or cuBLAS calls, collectives as asynchronous start/done pairs
where XLA:GPU makes them so, and buffer sizes well inside an H100's 80 GB.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from meshtron.checkpoint import abstract_like
from meshtron.config import load_config
from meshtron.hlo.collectives import Collective, collectives
from meshtron.hlo.gemms import gemms
from meshtron.hlo.summary import analyze

pytestmark = [pytest.mark.gpu_compile, pytest.mark.slow]

H100_BYTES = 80 * 10**9
# Small models: a compile is about the program's size, and these keep every feature's structure.
SMALL = ["model.hidden=64", "model.heads=4", "model.mlp_dim=128", "model.seq_len=64", "model.vocab_size=256",
         "train.steps=10", "train.warmup_steps=1"]
# cuDNN's fused attention (bf16 compute): its custom call in the program (tests/test_gpu_attention.py has the
# plain data and tensor layouts and the memory it saves).
CUDNN = ["model.attention=cudnn", "model.dtype=bfloat16"]
FUSED = "__cudnn$fmha"
_ASYNC_STARTS = re.compile(r"\s(all-reduce-start|all-gather-start|collective-permute-start|reduce-scatter-start"
                           r"|all-to-all-start|async-start)\(")


def mesh(data: int, pipe: int = 1, tensor: int = 1, context: int = 1, *, microbatches: int = 2) -> list[str]:
    """Overrides for a ``data x pipe x tensor x context`` mesh and a batch of ``microbatches`` per data shard."""
    return [f"parallel.data={data}", f"parallel.pipe={pipe}", f"parallel.tensor={tensor}", f"parallel.context={context}",
            f"parallel.microbatches={microbatches}", f"train.batch_size={data * microbatches * 2}"]


def trainer(gpu_target: str, base: str, *overrides: str):
    from meshtron.train.loop import Trainer

    cfg = load_config(base, [*SMALL, *overrides])
    tr = Trainer.from_config(cfg, target=gpu_target, read_data=False)
    assert {d.device_kind for d in tr.mesh.devices.flat} == {"NVIDIA H100 80GB HBM3"}
    return tr


def compile_step(tr, stage: str | None = None):
    """The train step of ``stage`` (default: the optimizer's first) compiled for the trainer's GPUs."""
    params, opt_state, tokens = tr.abstract_step_arguments()
    return tr.steps.compile(params, opt_state, tokens, stage or tr.steps.stages[0])


def gpu_program(compiled, mesh) -> list[Collective]:
    """Assert ``compiled`` is XLA:GPU's program and its memory fits an H100; its collectives."""
    text = compiled.as_text()
    header = text.split("\n", 1)[0]
    assert header.startswith("HloModule ") and "is_scheduled=true" in header, header[:200]
    assert "__triton" in text or "__cublas" in text  # matmuls as GPU kernels: XLA:CPU has neither
    memory = analyze(compiled, mesh).memory
    assert memory is not None
    assert memory.argument_size_in_bytes > 0 and memory.temp_size_in_bytes > 0
    assert 0 < memory.total_bytes < H100_BYTES
    return collectives(compiled, mesh)


def kinds(colls: list[Collective]) -> set[tuple[str, tuple[str, ...]]]:
    return {(c.kind, c.axes) for c in colls}


def asynchronous(compiled) -> set[str]:
    """The async collective start opcodes the scheduled program holds."""
    return set(_ASYNC_STARTS.findall(compiled.as_text()))


def over(colls: list[Collective], kind: str, axis: str) -> list[Collective]:
    return [c for c in colls if c.kind == kind and axis in c.axes]


# ---- pipeline schedules -------------------------------------------------------------------------------


def test_interleaved_with_tensor_sequence_parallel_zero1_and_cudnn_attention(gpu_target):
    # cpu8's mesh: 2 data x 2 stages (interleaved, 2 chunks each) x 2 tensor, Megatron's sequence parallelism.
    tr = trainer(gpu_target, "cpu8", *mesh(2, 2, 2, microbatches=4), "model.layers=4", "parallel.schedule=interleaved",
                 "parallel.chunks=2", "parallel.sequence_parallel=true", "parallel.zero=1", *CUDNN)
    compiled = compile_step(tr)
    assert FUSED in compiled.as_text()  # cuDNN's fused attention, forward and backward
    colls = gpu_program(compiled, tr.mesh)
    found = kinds(colls)
    assert ("collective-permute", ("pipe",)) in found  # activations between stages
    # Sequence parallelism: the residual stream gathered before, reduce-scattered after each tensor-parallel block.
    assert over(colls, "all-gather", "tensor") and over(colls, "reduce-scatter", "tensor")
    # ZeRO-1: gradients reduce-scattered over data, updated parameters all-gathered back.
    assert ("reduce-scatter", ("data",)) in found and ("all-gather", ("data",)) in found
    assert {"all-reduce-start", "collective-permute-start"} <= asynchronous(compiled)


def test_gpipe_on_an_uneven_layout_without_zero(gpu_target):
    tr = trainer(gpu_target, "cpu8", *mesh(4, 2, 1, microbatches=2), "model.layers=3", "parallel.schedule=gpipe",
                 "parallel.chunks=1", "parallel.layout=[1,2]", "parallel.zero=0")
    assert tr.stage_layout.counts == (1, 2)
    colls = gpu_program(compile_step(tr), tr.mesh)
    assert ("collective-permute", ("pipe",)) in kinds(colls)
    assert over(colls, "all-reduce", "data")  # zero=0: the whole gradient all-reduced over data
    assert not over(colls, "reduce-scatter", "data") and not over(colls, "all-gather", "data")


def test_1f1b_p_on_packed_documents(gpu_target):
    tr = trainer(gpu_target, "cpu8", *mesh(2, 2, 2, microbatches=2), "model.layers=2", "parallel.schedule=1f1b-p",
                 "parallel.chunks=1", "data.reset_per_document=true")
    params, opt_state, tokens = tr.abstract_step_arguments()
    assert tokens.shape == (tr.cfg.train.batch_size, 65, 3)  # tokens, positions, document ids
    compiled = tr.steps.compile(params, opt_state, tokens, tr.steps.stages[0])
    found = kinds(gpu_program(compiled, tr.mesh))
    assert ("collective-permute", ("pipe",)) in found and ("all-reduce", ("tensor",)) in found


def test_zero_bubble_with_zero1_lora_and_cudnn_attention(gpu_target):
    tr = trainer(gpu_target, "cpu8", *mesh(4, 2, 1, microbatches=2), "model.layers=2", "parallel.schedule=zb-h1",
                 "parallel.chunks=1", "parallel.zero=1", "train.lora.rank=4", "train.lora.alpha=8", *CUDNN)
    compiled = compile_step(tr)
    assert FUSED in compiled.as_text()
    # model.fp8=off (the default): no GEMM of zb-h1's forward, input- and weight-gradient passes has float8
    # operands (with FP8, every block GEMM has: tests/test_fp8.py)
    found = [g for g in gemms(compiled) if not g.attention]
    assert found and not any(g.f8 for g in found)
    colls = gpu_program(compiled, tr.mesh)
    assert ("collective-permute", ("pipe",)) in kinds(colls)
    # Only the adapters train: what ZeRO-1 reduce-scatters over data is a small part of the model.
    scattered = over(colls, "reduce-scatter", "data")
    assert scattered
    model_bytes = 4 * sum(x.size for x in jax.tree.leaves(tr.model_def.shapes()))
    assert sum(c.bytes for c in scattered) * 4 < model_bytes / 4


def test_1f1b_with_experts_split_over_data(gpu_target):
    tr = trainer(gpu_target, "mixtral_cpu8", *mesh(2, 2, 2, microbatches=4), "model.layers=2", "model.kv_heads=2",
                 "model.moe.experts=4", "model.moe.mlp_dim=64", "parallel.schedule=1f1b", "parallel.chunks=1")
    compiled = compile_step(tr)
    colls = gpu_program(compiled, tr.mesh)
    found = kinds(colls)
    assert ("all-to-all", ("data",)) in found  # tokens to and from their experts' data ranks
    assert "all-to-all-start" in asynchronous(compiled)  # XLA:GPU overlaps them with compute
    assert ("collective-permute", ("pipe",)) in found and ("all-reduce", ("tensor",)) in found


# ---- context parallelism and ZeRO-3 -------------------------------------------------------------------


def test_ring_context_attention_with_zero3_gathered_once(gpu_target):
    tr = trainer(gpu_target, "cpu8", *mesh(2, 1, 2, 2), "model.layers=2", "parallel.context_attention=ring",
                 "parallel.zero=3", "parallel.gather_once=true")
    colls = gpu_program(compile_step(tr), tr.mesh)
    found = kinds(colls)
    assert ("collective-permute", ("context",)) in found  # key/value blocks passed around the ring
    assert ("all-gather", ("context",)) not in found  # ... never gathered over the sequence's ranks
    # ZeRO-3 splits parameters and gradients over data x context (gradients are reduced over both);
    # gather_once: the parameters are gathered once per step, not per layer and pass.
    gathers = over(colls, "all-gather", "data")
    assert gathers and all(c.axes == ("data", "context") and c.count == 1 for c in gathers)
    assert ("reduce-scatter", ("data", "context")) in found


def test_gathered_context_attention_with_zero3(gpu_target):
    tr = trainer(gpu_target, "cpu8", *mesh(2, 1, 1, 4), "model.layers=2", "parallel.context_attention=gathered",
                 "parallel.zero=3")
    colls = gpu_program(compile_step(tr), tr.mesh)
    found = kinds(colls)
    assert ("all-gather", ("context",)) in found  # keys and values gathered over the sequence's ranks
    assert ("collective-permute", ("context",)) not in found
    # Per-layer ZeRO-3: each layer's parameters gathered before its use, in the forward and again in the backward.
    per_layer = [c for c in over(colls, "all-gather", "data") if c.count >= 2]
    assert per_layer
    assert over(colls, "reduce-scatter", "data")


# The CI tier compiles the chosen bf16 reduction (both dtypes of the claim in one program: gathers and
# reductions in bf16); the fp32 default is a further case (make test compiles it).
@pytest.mark.parametrize("reduce_dtype", [pytest.param("float32", marks=pytest.mark.extended), "bfloat16"])
def test_zero3_gathers_in_the_compute_dtype_and_reduces_in_the_chosen_one(gpu_target, reduce_dtype):
    """A bf16 model held in fp32: its layers are gathered in bf16 (half the bytes) and their gradients
    reduce-scattered in fp32 by default, or in bf16 with ``parallel.reduce_dtype=bfloat16``."""
    base = [*mesh(8), "model.layers=2", "model.family=llama", "model.kv_heads=2", "model.dtype=bfloat16",
            "parallel.zero=3"]
    tr = trainer(gpu_target, "cpu8", *base, *(["parallel.reduce_dtype=bfloat16"] if reduce_dtype == "bfloat16" else []))
    colls = gpu_program(compile_step(tr), tr.mesh)
    gathers, scatters = over(colls, "all-gather", "data"), over(colls, "reduce-scatter", "data")
    assert gathers and {c.dtype for c in gathers} == {"bf16"}
    assert scatters and {c.dtype for c in scatters} == {"f32" if reduce_dtype == "float32" else "bf16"}


# ---- 1-bit LAMB ---------------------------------------------------------------------------------------


def test_onebit_lamb_warmup_and_compression(gpu_target):
    tr = trainer(gpu_target, "cpu8", *mesh(4, 1, 2), "model.layers=2", "train.optimizer=onebit_lamb",
                 "optim.freeze_step=2")
    assert tr.steps.stages == ("warmup", "compression")
    warmup = [c for c in gpu_program(compile_step(tr, "warmup"), tr.mesh) if "data" in c.axes]
    compression = [c for c in gpu_program(compile_step(tr, "compression"), tr.mesh) if "data" in c.axes]
    assert {(c.kind, c.dtype) for c in warmup} == {("all-reduce", "f32")}  # the full-precision gradient
    # Compression: signs as bytes (u8) exchanged all-to-all and gathered, the scales in f32. XLA:GPU's
    # all-gather combiner sends the gathered signs and their scales as one all-gather (u8+f32).
    assert ("all-to-all", "u8") in {(c.kind, c.dtype) for c in compression}
    assert [c for c in compression if c.kind == "all-gather" and "u8" in c.dtype.split("+")]
    assert sum(c.total_wire_bytes for c in warmup) > 8 * sum(c.total_wire_bytes for c in compression)


# ---- evaluation and generation ------------------------------------------------------------------------


def test_pipelined_evaluation(gpu_target):
    tr = trainer(gpu_target, "cpu8", *mesh(2, 2, 2, microbatches=4), "model.layers=4", "parallel.schedule=interleaved",
                 "parallel.chunks=2")
    params, _, tokens = tr.abstract_step_arguments()
    compiled = tr.steps.lower_eval(params, tokens).compile()
    colls = gpu_program(compiled, tr.mesh)
    found = kinds(colls)
    assert ("collective-permute", ("pipe",)) in found and ("all-reduce", ("tensor",)) in found
    # A forward pass only: no gradient reduced or scattered over data, only the loss averaged.
    assert all(c.bytes <= 64 for c in colls if "data" in c.axes)


def test_generation_with_a_kv_cache(gpu_target):
    from meshtron.generate import Sampler
    from meshtron.models.attention import attention_implementation
    from meshtron.sharding import axis_rules

    tr = trainer(gpu_target, "llama_cpu8", *mesh(4, 1, 2), "model.layers=2", "model.kv_heads=2")
    sampler = Sampler(tr.model_def, tr.mesh, execution=tr.execution, chunk=8)
    assert sampler.use_cache
    replicated = NamedSharding(tr.mesh, PartitionSpec())

    def scalar(value):
        shape = jax.eval_shape(lambda: value)
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=replicated)

    params = abstract_like(tr.model_def.shapes(), sampler.param_shardings)
    window = jax.ShapeDtypeStruct((sampler.context,), np.int32, sharding=replicated)
    settings = (scalar(jax.random.key(0)), scalar(np.float32(0)), scalar(np.int32(1)), scalar(np.float32(1)))  # key, temperature, top-k, top-p
    with jax.set_mesh(tr.mesh), axis_rules(sampler._rules), attention_implementation(tr.execution.attention), \
            tr.model_def.adapted():
        cache = sampler._empty_cache.lower(params).out_info
        compiled = sampler._decode.lower(params, window, scalar(np.int32(1)), scalar(np.bool_(False)), cache,
                                         *settings, scalar(np.int32(0)), scalar(np.int32(8))).compile()
    colls = gpu_program(compiled, tr.mesh)
    assert over(colls, "all-reduce", "tensor")  # the row-parallel projections' partial sums
    assert not [c for c in colls if "data" in c.axes]  # one sequence, replicated over data
    assert " while(" in compiled.as_text()  # the decoding loop runs on the device
