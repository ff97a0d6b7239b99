"""``parallel.gradient_accumulation_fusion``: each projection's weight gradient leaves its GEMM in float32
(:mod:`meshtron.models.master_weight_gemm`). The loss is the unfused path's and the gradients equal it
within bf16's rounding of the unfused ``dW``, on one device and through a pipeline that keeps its
residuals; on a compile-only H100 the accumulation ``g += dW`` of every block weight is the GEMM's own
epilogue, with no element-wise pass of its own."""

from __future__ import annotations

import re
from dataclasses import replace

import jax
import numpy as np
import pytest

from meshtron.config import ModelConfig, load_config
from meshtron.execution import DEFAULT_EXECUTION
from meshtron.mesh import build_mesh
from meshtron.testing import Layout, _gradients
from meshtron.train.state import model_def_from_config

# Llama in bf16 with float32 parameters: the fused query/key/value and gate/up projections (tensor > 1) and
# the plain ones (one device) both run.
LAYOUTS = [Layout(1, 1, 1, microbatches=2), Layout(1, 2, 4, "1f1b", recompute=False)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_loss_and_gradients_equal_the_unfused_path(layout):
    md = model_def_from_config(ModelConfig(family="llama", vocab_size=256, hidden=64, heads=8, kv_heads=2, layers=4,
                                           mlp_dim=128, seq_len=16, dtype="bfloat16"), layout.tensor)
    devices = jax.devices()
    params = jax.device_get(md.init(build_mesh(_single(), devices[:1]), 0))
    tokens = np.random.default_rng(0).integers(0, 256, size=(4, 17), dtype=np.int32)
    plain = _gradients(md, layout, params, tokens, devices, DEFAULT_EXECUTION)
    fused = _gradients(md, layout, params, tokens, devices, replace(DEFAULT_EXECUTION, gradient_accumulation_fusion=True))
    assert fused[0] == pytest.approx(plain[0], rel=1e-6)  # the same forward
    differ = 0
    for g, r in zip(jax.tree.leaves(fused[1]), jax.tree.leaves(plain[1]), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        # bf16 rounds the unfused dW to 8 bits of mantissa: 0.4% of an element, less of a norm
        assert np.linalg.norm(g - r) <= 1e-2 * np.linalg.norm(r) + 1e-8
        differ += int(not np.array_equal(g, r))
    assert differ > 0  # the float32 weight gradients are not the bf16 ones: the fused path ran


def _single():
    from meshtron.config import MeshConfig

    return MeshConfig(1, 1, 1)


_EPILOGUE = re.compile(r"ROOT %[\w.\-]+ = f32\[[^\]]*\]\{[^}]*\} add\(")
_F32_ADD = re.compile(r"= f32\[(\d+,\d+)\]\{[^}]*\} add\(")


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("fusion", [False, True])
def test_h100_step_adds_weight_gradients_in_the_gemm(gpu_target, fusion):
    """A 1F1B step with kept residuals on 4 H100s (tokens per microbatch and weights large enough for
    XLA to run each weight gradient as one GEMM, as at Llama-2's sizes): with the fusion, the block weights' float32 gradient
    accumulators are added by their GEMMs (GEMM fusions whose root is ``acc + dot``), and no element-wise
    fusion adds an accumulator of a block weight's shape; without it, those additions are fusions of their own."""
    from meshtron.train.loop import Trainer

    cfg = load_config("cpu8", ["model.family=llama", "model.hidden=1024", "model.heads=8", "model.kv_heads=4",
                               "model.mlp_dim=2048", "model.layers=4", "model.seq_len=512", "model.vocab_size=256",
                               "model.dtype=bfloat16", "model.attention=cudnn", "parallel.data=1", "parallel.pipe=2",
                               "parallel.tensor=2", "parallel.microbatches=4", "train.batch_size=4",
                               "parallel.schedule=1f1b", "parallel.chunks=1", "parallel.recompute=false",
                               f"parallel.gradient_accumulation_fusion={str(fusion).lower()}",
                               # XLA joins GEMMs that share an operand below 32 MB (gate and up here, not at
                               # Llama-2's sizes), and one joined weight gradient cannot add into two accumulators
                               "gpu.xla_flags=--xla_gpu_dot_merger_threshold_mb=0"])
    tr = Trainer.from_config(cfg, target=gpu_target, read_data=False)
    params, opt_state, tokens = tr.abstract_step_arguments()
    text = tr.steps.compile(params, opt_state, tokens, tr.steps.stages[0]).as_text()
    # block weights on a tensor rank, as 2-D GEMM outputs: gate, up and down [1024, 1024], the attention
    # output [512, 1024] (key and value, [1024, 128], are thin enough for XLA to split their GEMMs over the
    # tokens, which leaves the sum of the parts to a fusion of its own either way)
    kernels = {"1024,1024", "512,1024", "1024,512"}
    gemms = re.findall(r"\n(%[\w.\-]+) \([^\n]*\) -> f32\[([\d,]*)\][^\n]*\{\n(.*?)\n\}", text, re.DOTALL)
    epilogues = {shape for _, shape, body in gemms if " dot(" in body and _EPILOGUE.search(body)}
    computations = re.findall(r"\n(%[\w.\-]+) \([^\n]*\) -> [^\n]*\{\n(.*?)\n\}", text, re.DOTALL)
    separate = {shape for _, body in computations if " dot(" not in body for shape in _F32_ADD.findall(body)}
    if fusion:
        assert epilogues & kernels and not separate & kernels, (epilogues, separate)
    else:
        assert not epilogues & kernels and separate & kernels, (epilogues, separate)
