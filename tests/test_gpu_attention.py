"""``model.attention=cudnn`` compiles for H100 targets on every layout, and the compiled step uses it.

JAX lowers cuDNN attention through ``custom_partitioning``, which fails inside the train step's partly
manual ``shard_map`` (jax-ml/jax#21584); :mod:`meshtron.models.fused_attention` calls it where every mesh
axis is manual. These tests compile small Llama train steps for 8 compile-only H100s (no GPU needed,
JAX's CUDA plugin is) and read the compiled programs: the fused-attention custom call is there, and the
program's temporaries are smaller than the XLA attention's at a sequence where the ``[s, s]`` scores
matter. Numerics cannot be checked without a GPU; the XLA path, unchanged, is tested on CPU elsewhere.
"""

import functools
import re

import pytest

from meshtron.gpu.targets import prepare_environment

prepare_environment()  # before JAX's backends start: lets the CUDA plugin load without CUDA
pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for GPU targets needs JAX's CUDA plugin "
                    "(the gpu-compile extra)")

from meshtron.config import load_config
from meshtron.train.loop import Trainer

pytestmark = [pytest.mark.gpu_compile, pytest.mark.slow]

FUSED = "__cudnn$fmha"

SMALL = ["model.dtype=bfloat16", "model.hidden=64", "model.heads=8", "model.kv_heads=8", "model.mlp_dim=128",
         "model.layers=2", "model.seq_len=128", "train.batch_size=16", "parallel.microbatches=2"]


def compiled_step(layout: str, attention: str, *overrides: str):
    """The compiled train step of a small bf16 Llama on 8 H100s laid out ``data x pipe x tensor``."""
    data, pipe, tensor = layout.split("x")
    cfg = load_config("llama_cpu8", [f"parallel.data={data}", f"parallel.pipe={pipe}", f"parallel.tensor={tensor}",
                                     *SMALL, f"model.attention={attention}", *overrides])
    trainer = Trainer.from_config(cfg, target="h100", read_data=False)
    return trainer.steps.compile(*trainer.abstract_step_arguments(), trainer.steps.stages[0])


@pytest.mark.parametrize(("layout", "overrides"), [
    pytest.param("1x1x8", (), marks=pytest.mark.extended),
    ("1x1x8", ("model.kv_heads=2",)),  # fewer key/value heads than tensor ranks: each keeps the one it reads
    pytest.param("2x1x4", ("parallel.sequence_parallel=true",), marks=pytest.mark.extended),
], ids=["tensor8", "tensor8-gqa", "sequence-parallel"])
def test_cudnn_attention_compiles_into_the_fused_kernel(layout, overrides):
    """Pipelined layouts with cuDNN (2x2x2 interleaved, zb-h1) are compiled by tests/test_gpu_compile.py;
    plain data parallelism (8x1x1) by test_fused_attention_keeps_no_scores, at a longer sequence."""
    text = compiled_step(layout, "cudnn", *overrides).as_text()
    assert FUSED in text  # forward and backward kernels, per layer


@pytest.mark.parametrize(("layout", "overrides"), [
    pytest.param("2x1x2", ("parallel.context=2",), marks=pytest.mark.extended),
    ("2x1x1", ("parallel.context=4", "data.reset_per_document=true")),
    pytest.param("2x1x2", ("parallel.context=2", "model.kv_heads=2"),  # key/value heads whole on both tensor ranks
                 marks=pytest.mark.extended),
], ids=["context2-tensor2", "context4-documents", "context2-gqa"])
def test_cudnn_over_a_split_sequence_with_gathered_keys_compiles_into_the_fused_kernel(layout, overrides):
    """Each rank's queries against the whole sequence's gathered keys, under a position mask (a bias)."""
    text = compiled_step(layout, "cudnn", "parallel.context_attention=gathered", *overrides).as_text()
    assert FUSED in text


def block_scores(text: str, tokens: int) -> list[str]:
    """The fp32 arrays of rank 4 or more whose last two dimensions are a ring's blocks of queries and keys
    (``tokens`` per rank, a block or its half): the ``[.., s_q, s_k]`` scores XLA's attention keeps."""
    sizes = {str(tokens), str(tokens // 2)}
    return sorted({shape for shape in re.findall(r"f32\[([\d,]+)\]", text)
                   if len(dims := shape.split(",")) >= 4 and set(dims[-2:]) <= sizes})


def assert_the_ring_runs_each_block_in_the_fused_kernels(fused_text: str, plain_text: str, tokens: int) -> None:
    """The ring's blocks go to cuDNN's forward and backward kernels (the backward from the whole
    attention's output and log-sum-exp), and no block's fp32 scores are left; XLA's ring keeps them."""
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', fused_text)
    assert any("Backward" in c for c in calls) and any("Backward" not in c for c in calls), sorted(set(calls))
    assert block_scores(fused_text, tokens) == []
    assert block_scores(plain_text, tokens) != []


def xla_ring_text(layout: str, *ring: str) -> str:
    """The control: XLA's attention by the ring on ``layout``, whose fp32 block scores block_scores finds.
    Packed documents mask the same blocks by position, so a case with them reads the program without."""
    return _xla_text(layout, *(o for o in ring if o != "data.reset_per_document=true"))


@functools.cache
def _xla_text(layout: str, *overrides: str) -> str:
    return compiled_step(layout, "xla", *overrides).as_text()


@pytest.mark.parametrize(("layout", "overrides"), [
    pytest.param("2x1x1", ("parallel.context=4",), marks=pytest.mark.extended),
    ("2x1x1", ("parallel.context=4", "data.reset_per_document=true")),
    pytest.param("2x1x2", ("parallel.context=2", "model.kv_heads=2"),  # key/value heads whole on both tensor ranks
                 marks=pytest.mark.extended),
], ids=["context4", "context4-documents", "context2-gqa"])
def test_cudnn_by_the_ring_compiles_each_block_into_the_fused_kernels(layout, overrides):
    """Two context ranks over two tensor ranks with every head are test_cudnn_by_the_ring_keeps_no_block_scores'
    layout (its two compiles check the same)."""
    # 192 tokens: no block (96 or 48 tokens per rank, and halves) is as long as the hidden size (64)
    ring = ("parallel.context_attention=ring", "model.seq_len=192", *overrides)
    tokens = 192 // (4 if "parallel.context=4" in overrides else 2)
    assert_the_ring_runs_each_block_in_the_fused_kernels(compiled_step(layout, "cudnn", *ring).as_text(),
                                                         xla_ring_text(layout, *ring), tokens)


def test_cudnn_by_the_ring_keeps_no_block_scores():
    """At 2,048 tokens over two context ranks, one row's [h, s/2, s/2] fp32 block scores are megabytes."""
    longer = ("model.seq_len=2048", "train.batch_size=8", "parallel.microbatches=1", "parallel.context=2",
              "parallel.context_attention=ring")
    fused = compiled_step("2x1x2", "cudnn", *longer)
    plain = compiled_step("2x1x2", "xla", *longer)
    # 2,048 tokens: no block (1,024 tokens per rank, and halves) is as long as the hidden size (64)
    assert_the_ring_runs_each_block_in_the_fused_kernels(fused.as_text(), plain.as_text(), 2048 // 2)
    fused_bytes = fused.memory_analysis().temp_size_in_bytes
    plain_bytes = plain.memory_analysis().temp_size_in_bytes
    scores = 4 * 1024 * 1024 * 4  # one row's [h, s/2, s/2] fp32 scores, per device (4 heads per tensor rank)
    assert plain_bytes - fused_bytes >= scores, (fused_bytes, plain_bytes)


def test_fused_attention_keeps_no_scores():
    """At seq 2048, one [b, h, s, s] fp32 score tensor per microbatch row is megabytes; cuDNN keeps none."""
    longer = ("model.seq_len=2048", "train.batch_size=8", "parallel.microbatches=1")
    fused = compiled_step("8x1x1", "cudnn", *longer)
    plain = compiled_step("8x1x1", "xla", *longer)
    assert FUSED in fused.as_text() and FUSED not in plain.as_text()
    fused_bytes = fused.memory_analysis().temp_size_in_bytes
    plain_bytes = plain.memory_analysis().temp_size_in_bytes
    scores = 1 * 8 * 2048 * 2048 * 4  # one row's [h, s, s] fp32 scores, per device
    assert plain_bytes - fused_bytes >= scores, (fused_bytes, plain_bytes)


@pytest.mark.parametrize(("layout", "overrides"), [
    pytest.param("8x1x1", (), marks=pytest.mark.extended),
    ("2x1x4", ("parallel.sequence_parallel=true",)),
], ids=["data8", "sequence-parallel"])
def test_cudnn_attention_with_packed_documents_compiles_into_the_fused_kernel(layout, overrides):
    """The document mask (a query sees its own document's earlier keys) goes to cuDNN as a bias."""
    text = compiled_step(layout, "cudnn", "data.reset_per_document=true", *overrides).as_text()
    assert FUSED in text


def _is_all_to_all(instruction) -> bool:
    return "all-to-all" in instruction.opcode or (instruction.opcode.startswith("async")
                                                  and "all-to-all" in instruction.attributes)


def _reaches_all_to_all(start, step) -> bool:
    """Whether walking ``step`` (an instruction's operands, or its users) from ``start`` meets an all-to-all."""
    seen, todo = set(), list(step(start))
    while todo:
        instruction = todo.pop()
        if instruction.name in seen:
            continue
        seen.add(instruction.name)
        if _is_all_to_all(instruction):
            return True
        todo.extend(step(instruction))
    return False


def exchanged_around(text: str, kernel: str) -> list[tuple[bool, bool]]:
    """For each call of the cuDNN kernel ``kernel`` (its custom-call target): whether an all-to-all feeds it
    (through the reshapes, copies and fusions between) and whether its output reaches one, within the
    computation that runs it."""
    from meshtron.hlo.text import parse_hlo_module

    found = []
    for computation in parse_hlo_module(text).computations.values():
        by_name = {i.name: i for i in computation.instructions}
        users: dict[str, list] = {}
        for instruction in computation.instructions:
            for operand in instruction.operands:
                users.setdefault(operand, []).append(instruction)
        operands = functools.partial(lambda table, i: [table[o] for o in i.operands if o in table], by_name)
        readers = functools.partial(lambda table, i: table.get(i.name, []), users)
        for instruction in computation.instructions:
            if instruction.opcode == "custom-call" and f'custom_call_target="{kernel}"' in instruction.attributes:
                found.append((_reaches_all_to_all(instruction, operands), _reaches_all_to_all(instruction, readers)))
    return found


def test_cudnn_attention_runs_inside_the_ulysses_exchange():
    """Ulysses turns the sequence split into a head split with all-to-alls, so each rank's attention is an
    ordinary whole-sequence call: cuDNN's forward and backward kernels are each fed by an all-to-all over
    context and feed one, on 4 context ranks x 2 tensor ranks, each tensor rank's one key/value head
    repeated to the 4 ranks' (8 query heads: 1 per device, over all 128 tokens)."""
    text = compiled_step("1x1x2", "cudnn", "parallel.context=4", "parallel.context_attention=ulysses",
                         "model.kv_heads=2").as_text()
    kernels = sorted(set(re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text)))
    assert any("Backward" in k for k in kernels) and any("Backward" not in k for k in kernels), kernels
    for kernel in kernels:
        around = exchanged_around(text, kernel)
        assert around and all(before and after for before, after in around), (kernel, around)
    calls = [line for line in text.splitlines() if 'custom_call_target="__cudnn$fmha' in line]
    assert any(re.search(r"bf16\[\d+,128,1,8\]", line) for line in calls), calls[:2]


def test_cudnn_runs_each_ring_block_of_the_hybrid_between_its_all_to_alls():
    """The hybrid over 4 context ranks, u = 2, on 2 tensor ranks: the all-to-alls give each group's 96 tokens
    for 2 heads, whose ring of 2 groups runs each block in cuDNN's forward and backward kernels, no block's
    fp32 scores kept (XLA's ring keeps them: test_cudnn_by_the_ring_compiles_each_block_into_the_fused_kernels).
    192 tokens: no block (96, or a half of 48) is as long as the hidden size (64)."""
    text = compiled_step("1x1x2", "cudnn", "parallel.context=4", "parallel.context_attention=hybrid",
                         "parallel.ulysses_degree=2", "model.seq_len=192").as_text()
    assert "all-to-all" in text and "collective-permute" in text
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text)
    assert any("Backward" in c for c in calls) and any("Backward" not in c for c in calls), sorted(set(calls))
    assert block_scores(text, 96) == []
