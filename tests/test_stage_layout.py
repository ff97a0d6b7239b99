"""parallel.layout: which layers each virtual stage runs, in counts or Megatron's layout string; a
layout that does not add up is one clear error naming the field."""

import numpy as np
import pytest

from meshtron.cli import main
from meshtron.config import ConfigError, ModelConfig, load_config
from meshtron.pipeline.layout import LayoutError, StageLayout
from meshtron.run import resolve_run
from meshtron.testing import Layout, check_parity
from meshtron.train.pipelined import canonical_positions, stage_order
from meshtron.train.state import model_def_from_config

pytestmark = pytest.mark.slow

SMALL = ModelConfig(vocab_size=256, hidden=32, heads=4, layers=8, mlp_dim=64, seq_len=16)
MODEL_DEF = model_def_from_config(SMALL, 4)


def test_even_layout_is_megatrons_placement():
    # The old closed form: position s·(L/p) + c·(L/(p·v)) + j holds layer c·(L/v) + s·(L/(p·v)) + j.
    for layers, p, v in [(8, 2, 2), (8, 4, 1), (12, 2, 3), (6, 3, 2)]:
        per = layers // (p * v)
        s, c, j = np.meshgrid(np.arange(p), np.arange(v), np.arange(per), indexing="ij")
        assert StageLayout.even(layers, p, v).stage_order().tolist() == \
            (c * (layers // v) + s * per + j).reshape(-1).tolist()


@pytest.mark.parametrize("spec, counts", [
    ([3, 5], (3, 5)),
    ("3,5", (3, 5)),
    ("Ettt|tttttL", (3, 5)),
    ("Et*3|t*5L", (3, 5)),
    ("E t*3 | t*5 L", (3, 5)),
    ("ttt|ttttt", (3, 5)),  # E and L may be left out
    ("E(tt|)*3ttL", (2, 2, 2, 2)),
    ("Et|(t*2|)*2t*3L", (1, 2, 2, 3)),
])
def test_layouts_are_read_as_counts_per_virtual_stage(spec, counts):
    virtual = len(counts)
    p, v = (virtual, 1) if virtual != 4 else (2, 2)
    assert StageLayout.parse(spec, sum(counts), p, v).counts == counts


def test_uneven_stage_order_pads_each_chunk_to_the_largest():
    # p=2, v=2, counts per virtual stage k = c·p + s: (1, 2, 3, 2) -> 8 layers in slots of 3.
    layout = StageLayout.parse([1, 2, 3, 2], 8, 2, 2)
    order = layout.stage_order()
    # stage 0: chunk 0 = virtual 0 = layer 0; chunk 1 = virtual 2 = layers 3, 4, 5
    # stage 1: chunk 0 = virtual 1 = layers 1, 2; chunk 1 = virtual 3 = layers 6, 7
    assert order.tolist() == [0, -1, -1, 3, 4, 5, 1, 2, -1, 6, 7, -1]
    assert layout.padded_layers == 12 and not layout.is_even
    pos = canonical_positions(order)
    assert order[pos].tolist() == list(range(8))
    assert stage_order(8, 2, 2, layout).tolist() == order.tolist()


@pytest.mark.parametrize("spec, message", [
    ([3, 4], "the layout has 7 layers (3 + 4), the model 8; make them add up to 8"),
    ([2, 2, 4], "3 virtual stages given, parallel.pipe=2 x parallel.chunks=1 needs 2"),
    ("tEttt|ttttL", "E (the embedding) in virtual stage 0; meshtron embeds on virtual stage 0"),
    ("Etttt|Ltttt", "L (the loss) in virtual stage 1; meshtron computes the loss after the last"),
    ("Ettt|ttttxL", "unknown symbol(s) 'x'"),
    ([-1, 9], "layer counts must be >= 0"),
    ([0, 0], "the layout has 0 layers"),
    ({"a": 1}, "expected a list of layer counts per virtual stage"),
])
def test_layouts_that_do_not_fit_name_the_problem(spec, message):
    with pytest.raises(LayoutError, match=None) as err:
        StageLayout.parse(spec, 8, 2, 1)
    assert message in str(err.value)


CPU8 = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.schedule=1f1b", "parallel.chunks=1"]


def resolved(*overrides: str):
    """The run a config describes on 8 devices (where the pipeline is checked and built)."""
    return resolve_run(load_config("cpu8", list(overrides)), 8)


def test_config_errors_name_pipeline_layout(capsys):
    with pytest.raises(ConfigError) as err:
        resolved(*CPU8, "model.layers=8", "parallel.layout=[3,4]")
    assert str(err.value).startswith("parallel.layout: the layout has 7 layers")
    # Layers that do not split evenly, no layout: the fix names parallel.layout with an example.
    with pytest.raises(ConfigError) as err:
        resolved(*CPU8, "model.layers=7")
    assert str(err.value).startswith("model.layers: 7 layers cannot be split evenly")
    assert "parallel.layout (e.g. [4, 3])" in str(err.value)
    with pytest.raises(ConfigError) as err:
        resolved("parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.layout=[3,5]")
    assert str(err.value).startswith("parallel.layout: is set but parallel.pipe=1")
    # The CLI resolves the run before JAX starts: --print-config prints no config that cannot run.
    assert main(["train", "--config", "cpu8", *CPU8, "model.layers=7", "--print-config"]) == 2
    assert capsys.readouterr().err.startswith("meshtron: error: model.layers: 7 layers cannot be split evenly")


def test_a_config_with_a_layout_string_loads():
    run = resolved(*CPU8, "model.layers=7", "parallel.layout=Et*3|t*4L")
    assert run.cfg.pipeline.layout == "Et*3|t*4L" and run.stage_layout.counts == (3, 4)


# parallel.layout: uneven stages (padded chunks, the padding skipped) on the three meshes, through the
# fused, interleaved and split backwards, recomputing (1f1b-p: in the forward tick before) or keeping
# residuals (evaluation: test_pipeline.py).
# zb-h1 at m = p = 2 (m = 2p compiled twice the ticks): B and W still split, stage 1's W deferred past
# its next B; zb-h1's steady state at m = 2p: tests/test_pipeline.py's every-schedule grid.
UNEVEN = [
    Layout(1, 4, 2, "1f1b", layer_layout=(1, 3, 2, 2)),
    Layout(2, 2, 2, "interleaved", 2, layer_layout="Et|t*2|t*3|t*2L"),
    Layout(1, 2, 4, "zb-h1", microbatches=2, layer_layout=(2, 6), recompute=False),
    Layout(1, 4, 2, "1f1b-p", layer_layout=(3, 1, 2, 2)),  # every backward from a rerun hoisted a tick early
]


# CI: the interleaved, split and hoisted backwards; the fused one (1F1B on (1,4,2), the mesh of 1F1B-p's case
# here) is ``extended``.
@pytest.mark.parametrize("layout", [pytest.param(layout, marks=pytest.mark.extended) if layout.schedule == "1f1b"
                                    else layout for layout in UNEVEN], ids=str)
def test_uneven_layouts_match_the_unpipelined_model(layout):
    [report] = check_parity(MODEL_DEF, [layout], seq_len=16)
    assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6)


def test_layers_that_do_not_divide_into_the_stages_run_with_a_layout():
    # 7 layers on p=2 x v=2: Megatron's even split is impossible; a layout places them.
    md = model_def_from_config(ModelConfig(**{**SMALL.__dict__, "layers": 7}), 4)
    [report] = check_parity(md, [Layout(1, 2, 4, "interleaved", 2, layer_layout=(2, 2, 2, 1))], seq_len=16)
    assert report.ok
