"""Llama, built on the public contract only: the parity oracle on every kind of layout, with fewer
and with more key/value heads than tensor ranks, and the key/value layout rule."""

import jax
import pytest

from meshtron.config import ConfigError, MeshConfig, ModelConfig, load_config
from meshtron.mesh import build_mesh
from meshtron.run import check_features
from meshtron.testing import Layout, check_parity
from meshtron.train.state import model_def_from_config

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]

# On the second stack: replicated kv heads (1,1,8), split ones under a pipeline (2,2,2), kept residuals.
# Every schedule runs there on GPT (tests/test_pipeline.py); the rest run on the first stack.
_FIRST = pytest.mark.first_stack_only
# zb-h1 at m = p = 2 (m = 2p compiled twice the ticks): B and W still split, stage 1's W deferred past
# its next B; zb-h1's steady state at m = 2p: tests/test_pipeline.py's every-schedule grid.
LAYOUTS = [Layout(1, 1, 8), Layout(2, 2, 2, "interleaved", 2),
           pytest.param(Layout(2, 4, 1, "1f1b"), marks=_FIRST), pytest.param(Layout(1, 2, 4, "gpipe"), marks=_FIRST),
           pytest.param(Layout(2, 2, 2, "zb-h1", microbatches=2), marks=_FIRST), Layout(1, 2, 4, "1f1b", recompute=False)]


def llama(kv_heads: int) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=256, hidden=64, heads=8, kv_heads=kv_heads, layers=4, mlp_dim=128,
                       seq_len=16)


def _layouts_and_kv_heads():
    """kv2 is split over tensor=2 and replicated over tensor=8, so it runs on both stacks; kv8 on the first.
    CI runs the second stack's layouts (kv2; kv8, as many key/value heads as heads, on 2x2x2 interleaved);
    make test the rest (each schedule's own parity, on GPT: tests/test_pipeline.py)."""
    for param in LAYOUTS:
        layout, marks = (param.values[0], list(param.marks)) if hasattr(param, "values") else (param, [])
        first_stack_only = pytest.mark.first_stack_only in marks
        yield pytest.param(layout, 2, id=f"{layout}-kv2", marks=[*marks, *([pytest.mark.extended] * first_stack_only)])
        extended = [] if layout == Layout(2, 2, 2, "interleaved", 2) else [pytest.mark.extended]
        yield pytest.param(layout, 8, id=f"{layout}-kv8", marks=[*marks, pytest.mark.first_stack_only, *extended])


@pytest.mark.parametrize("layout, kv_heads", list(_layouts_and_kv_heads()))
def test_loss_and_gradients_equal_one_device(layout, kv_heads):
    # The model as a run on this layout builds it: vocabulary padding and key/value rule for its tensor size.
    md = model_def_from_config(llama(kv_heads), layout.tensor)
    [report] = check_parity(md, [layout])
    assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6)


@pytest.mark.parametrize("kv_heads, tensor, spec", [
    (8, 8, ("pipe", None, "tensor", None)),  # split: one kv head per rank
    (8, 2, ("pipe", None, "tensor", None)),
    (2, 8, ("pipe", None, None, None)),      # fewer kv heads than ranks: replicated (Megatron)
    (2, 2, ("pipe", None, "tensor", None)),
])
def test_key_value_heads_split_or_replicate(kv_heads, tensor, spec):
    md = model_def_from_config(llama(kv_heads), tensor)
    mesh = build_mesh(MeshConfig(8 // tensor, 1, tensor), jax.devices())
    shardings = md.shardings(mesh)
    assert shardings["blocks"]["attn"]["wk"]["kernel"].spec == jax.sharding.PartitionSpec(*spec)
    assert shardings["blocks"]["attn"]["wq"]["kernel"].spec == jax.sharding.PartitionSpec("pipe", None, "tensor", None)
    assert md.logical_axes()["blocks"]["attn"]["wk"]["kernel"] == ("layers", "embed", "kv_heads", "head_dim")


def test_kv_heads_that_fit_neither_way_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^model.kv_heads: 6 key/value heads can be neither split over nor "
                                          r"replicated across parallel.tensor=8; use a divisor or a multiple of 8"):
        _validated(["model.heads=24", "model.kv_heads=6", "parallel.tensor=8"])
    with pytest.raises(ConfigError, match=r"^model.kv_heads: 3 must be >= 1 and divide model.heads=4"):
        _validated(["model.kv_heads=3"])


def _validated(overrides):
    cfg = load_config("llama_cpu8", ["parallel.data=1", "parallel.pipe=1", "model.hidden=192", *overrides])
    check_features(cfg)
    return cfg
