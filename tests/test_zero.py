"""Optimizer state (zero=1) and parameters (zero=3) split over ``data``: the same training, the memory
and traffic the compiled step says, checkpoints that stay canonical."""

import math
import re
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshtron.checkpoint import CheckpointStore
from meshtron.config import ConfigError, load_config
from meshtron.describe import bytes_per_device
from meshtron.hlo.collectives import collectives
from meshtron.optim.zero import ZeroPlan
from meshtron.run import check_features
from meshtron.train.loop import Trainer
from meshtron.trees import leaf_names

MODEL = ["model.layers=4", "model.hidden=32", "model.heads=8", "model.mlp_dim=64", "model.seq_len=16",
         "train.batch_size=16", "train.warmup_steps=2", "train.eval_every=1000", "train.eval_batches=1"]


def mesh(data, pipe, tensor, schedule="1f1b", chunks=1, microbatches=2):
    return [f"parallel.data={data}", f"parallel.pipe={pipe}", f"parallel.tensor={tensor}", f"parallel.schedule={schedule}",
            f"parallel.chunks={chunks}", f"parallel.microbatches={microbatches}"]


def trainer(*overrides, **kwargs) -> Trainer:
    return Trainer.from_config(load_config(None, [*MODEL, *overrides]), **kwargs)


# ---- the plan ---------------------------------------------------------------------------------------


def test_a_leaf_is_split_along_its_largest_free_dimension_that_data_divides():
    shapes = {"blocks": {"w": jax.ShapeDtypeStruct((4, 32, 64), np.float32),   # [layers, embed, mlp]
                         "b": jax.ShapeDtypeStruct((4, 64), np.float32)},      # [layers, mlp]
              "wte": jax.ShapeDtypeStruct((256, 32), np.float32),             # [vocab, embed]
              "odd": jax.ShapeDtypeStruct((6, 3), np.float32)}
    specs = {"blocks": {"w": P("pipe", None, "tensor"), "b": P("pipe", "tensor")}, "wte": P("tensor", None),
             "odd": P()}
    stacked = {"blocks": {"w": True, "b": True}, "wte": False, "odd": False}
    plan = ZeroPlan.build(1, shapes, specs, stacked, size=4)
    # the embed dimension of w (tensor splits mlp, pipe the layers); nothing is free in b; the embed of
    # wte; odd has no dimension that 4 divides
    assert plan.dims == {"blocks": {"w": 1, "b": None}, "wte": 1, "odd": None}
    assert plan.specs(specs) == {"blocks": {"w": P("pipe", "data", "tensor"), "b": P("pipe", "tensor")},
                                 "wte": P("tensor", "data"), "odd": P()}
    assert plan.replicated() == [("blocks.b", 4 * 64 * 4), ("odd", 6 * 3 * 4)]
    assert not ZeroPlan.build(1, shapes, specs, stacked, size=1).active  # one data rank: nothing to split
    assert ZeroPlan.build(0, shapes, specs, stacked, size=4).replicated() == []


@pytest.mark.parametrize("override, message", [
    ("parallel.zero=2", "parallel.zero: must be 0 (replicated), 1 (optimizer state split over data) or 3"),
    ("parallel.gather_once=true", ("parallel.gather_once: gathers parameters split by parallel.zero=3, and this run has "
                               "parallel.zero=0")),
    ("parallel.reduce_dtype=bfloat16", ("parallel.reduce_dtype: sets the dtypes of parameters gathered by "
                                        "parallel.zero=3, and this run has parallel.zero=0")),
    ("parallel.gather_dtype=int8", "parallel.gather_dtype: must be one of"),
])
def test_bad_zero_settings_are_one_line(override, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check_features(load_config(None, [override]))


def test_onebit_lamb_says_why_its_state_cannot_be_split():
    with pytest.raises(ConfigError, match=r"^parallel.zero: 1-bit LAMB's error feedback compresses each worker's whole "
                                          r"local momentum .* an fp32 all-gather of the parameters every step "
                                          r"\(zero=1, 16x its 1-bit exchange\) .*; use parallel.zero=0 with onebit_lamb"):
        check_features(load_config(None, ["parallel.zero=1", "train.optimizer=onebit_lamb"]))


# ---- the same training ------------------------------------------------------------------------------

# (data x tensor without a pipeline under AdamW, as 4x1x2 was: 2x1x4-sequence-parallel here, and
# tests/test_context_parallel.py's zero levels on data x context x tensor; an 8-way split: 8x1x1-lamb)
LAYOUTS = {
    "2x2x2-interleaved": mesh(2, 2, 2, "interleaved", 2, 4),
    # m = p = 2: B and W split, stage 1's W deferred past the next B (4 microbatches doubled the compile)
    "2x2x2-zbh1-llama": [*mesh(2, 2, 2, "zb-h1", 1, 2), "model.family=llama", "model.kv_heads=4"],
    "8x1x1-lamb": [*mesh(8, 1, 1), "train.optimizer=lamb"],
    "2x1x4-sequence-parallel": [*mesh(2, 1, 4), "parallel.sequence_parallel=true", "model.remat=full"],
}


@pytest.mark.slow
# CI runs every level on 2x2x2 interleaved, the case that checks the most at once; make test the other layouts
@pytest.mark.parametrize("layout", [pytest.param(v, marks=pytest.mark.both_stacks) if "interleaved" in k
                                    else pytest.param(v, marks=pytest.mark.extended) for k, v in LAYOUTS.items()],
                         ids=list(LAYOUTS))
def test_zero_levels_train_like_replicated_state(layout):
    """The same losses and parameters at every zero level; on the interleaved pipeline, which runs every level,
    the compiled steps that trained also hold and send what :func:`assert_state_and_traffic` says."""
    steps = ["train.steps=3"]
    reference_trainer = trainer(*layout, *steps)
    reference = reference_trainer.run()
    variants = [["parallel.zero=1"], ["parallel.zero=3"]]
    if "zb-h1" in layout[3]:
        # zero=1 splits only the optimizer's update, after the pipeline, where every schedule is alike
        # (pipelined: the interleaved case); zero=3 gathers the weights in zb-h1's B and W passes
        variants = [["parallel.zero=3"]]
    if "interleaved" in layout[3]:
        variants.append(["parallel.zero=3", "parallel.gather_once=true"])
    trained = {}
    for zero in variants:
        t = trainer(*layout, *steps, *zero)
        result = t.run()
        trained[" ".join(zero)] = t
        np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-5, err_msg=str(zero))
        jax.tree.map(lambda a, b, zero=zero: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(zero)),
                     jax.device_get(result.params), jax.device_get(reference.params))
    if "interleaved" in layout[3]:
        assert_state_and_traffic(reference_trainer, trained["parallel.zero=1"], trained["parallel.zero=3"],
                                 trained["parallel.zero=3 parallel.gather_once=true"])


@pytest.mark.slow
@pytest.mark.extended  # the levels on the models meshtron ships: test_zero_levels_train_like_replicated_state
def test_a_users_model_trains_alike_at_every_zero_level(monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    import parallel_lm

    def run(*zero):
        t = Trainer.from_config(load_config(None, [*MODEL, *mesh(2, 2, 2, microbatches=2), "train.steps=3", *zero]),
                                model=parallel_lm.factory, rules=parallel_lm.RULES)
        return t.run()

    reference = run()
    for zero in (["parallel.zero=1"], ["parallel.zero=3"]):
        np.testing.assert_allclose(run(*zero).losses, reference.losses, rtol=1e-5)


BF16 = [*mesh(4, 1, 2), "model.family=llama", "model.kv_heads=4", "model.dtype=bfloat16", "train.steps=3"]


def assert_trains_like_bf16_reference(reference, *zero: str) -> None:
    """A run of the bf16 model at ``zero``: ``reference``'s losses to bf16's precision, its parameters' dtypes."""
    result = trainer(*BF16, *zero).run()
    np.testing.assert_allclose(result.losses, reference.losses, rtol=2e-2, err_msg=str(zero))
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a.dtype == b.dtype, result.params, reference.params)))


@pytest.mark.slow
def test_zero3_of_a_bf16_model_gathers_in_bf16_and_trains_like_replicated_state():
    """A bf16 model held in fp32 computes with bf16 weights at every zero level, so gathering them in
    bf16 (the default at zero=3) changes no matrix product: the losses agree to bf16's precision;
    ``parallel.gather_dtype=float32`` gathers the parameters as held, like zero=0 to fp32 rounding."""
    reference = trainer(*BF16).run()
    as_held = trainer(*BF16, "parallel.zero=3", "parallel.gather_dtype=float32").run()
    np.testing.assert_allclose(as_held.losses, reference.losses, rtol=1e-5)
    for zero in (["parallel.zero=3"], ["parallel.zero=3", "parallel.reduce_dtype=bfloat16"]):
        assert_trains_like_bf16_reference(reference, *zero)


@pytest.mark.slow
@pytest.mark.extended  # gathering once per step: CI runs it in fp32 (test_zero_levels_train_like_replicated_state)
def test_zero3_of_a_bf16_model_gathering_once_trains_like_replicated_state():
    assert_trains_like_bf16_reference(trainer(*BF16).run(), "parallel.zero=3", "parallel.gather_once=true")


# ---- memory and traffic of the compiled step ----------------------------------------------------------


def state_and_traffic(t: Trainer):
    """``t``'s compiled train step (the one its run compiled, if it ran): the bytes per device of its
    parameters and optimizer state, the bytes it sends over ``data``, and the bytes per device of the
    leaves the zero plan keeps whole."""
    params, opt_state, tokens = t.abstract_step_arguments()
    program = t.steps.compile(params, opt_state, tokens)
    # what one device holds, read from the shardings the compiled program takes
    param_in, opt_in = program.input_shardings[0][:2]

    data = sum(c.total_wire_bytes for c in collectives(program, t.mesh) if "data" in c.axes)
    whole = {n for n, _ in t.steps.zero.replicated()}  # the leaves the plan could not split
    kept = [(x, s) for n, x, s in zip(leaf_names(params), jax.tree.leaves(params), jax.tree.leaves(param_in),
                                      strict=True) if n in whole]
    return bytes_per_device(params, param_in), bytes_per_device(opt_state, opt_in), data, bytes_per_device(*zip(*kept)) if kept else 0


def compiled(*overrides):
    t = trainer(*overrides, read_data=False)
    return t, *state_and_traffic(t)


def assert_state_and_traffic(zero0: Trainer, zero1: Trainer, zero3: Trainer, zero3_once: Trainer) -> None:
    """zero=1 holds 1/d of the optimizer state, zero=3 of the parameters too (gathering them once per step or
    at each use alike), except what stays whole; the reduce-scatters and all-gathers move what zero=0's
    all-reduces moved."""
    params0, opt0, data0, _ = state_and_traffic(zero0)
    params1, opt1, data1, kept = state_and_traffic(zero1)
    params3, opt3, _, _ = state_and_traffic(zero3)
    params3once, opt3once, data3once, _ = state_and_traffic(zero3_once)
    d = zero0.mesh.shape["data"]
    # ``kept``: bytes per device of the leaves that stay whole on every data rank (biases split over tensor)
    assert params1 == params0 and opt1 < opt0
    # optimizer state: 1/d of it, except the 2 moments of what stays whole
    assert opt1 == pytest.approx((opt0 - 2 * kept) / d + 2 * kept, rel=0.02)
    assert params3 == pytest.approx((params0 - kept) / d + kept, rel=0.02) and opt3 == opt1
    assert params3once == params3 and opt3once == opt3
    # a reduce-scatter and an all-gather move what the all-reduce moved
    assert data1 == pytest.approx(data0, rel=0.05)
    assert data3once == pytest.approx(data0, rel=0.05)


@pytest.mark.slow  # on the interleaved pipeline: the compiled steps of test_zero_levels_train_like_replicated_state
@pytest.mark.extended  # (which CI runs) assert the same bytes
def test_compiled_state_and_traffic_bytes_per_device():
    layout = mesh(8, 1, 1, microbatches=2)
    assert_state_and_traffic(*(trainer(*layout, *zero, read_data=False) for zero in (
        [], ["parallel.zero=1"], ["parallel.zero=3"], ["parallel.zero=3", "parallel.gather_once=true"])))


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_zero3_traffic_is_its_formula(remat):
    """Layer by layer, every microbatch gathers each layer's parameters twice -- forward, and again in
    the backward: the whole layer recomputed (``remat=full``), or only its elementwise work with the
    matrix products kept -- and reduce-scatters its gradient; the embedding and head are gathered and
    reduced once per step; what stays whole is all-reduced. Ring bytes: (d-1)/d of a gather's or
    reduce-scatter's, twice that of an all-reduce."""
    gathers = 2
    m = 2
    t, _, _, data, kept = compiled(*mesh(8, 1, 1, microbatches=m), f"model.remat={remat}", "parallel.zero=3")
    d = t.mesh.shape["data"]
    shapes = t.model_def.shapes()
    sizes = {n: math.prod(x.shape) * x.dtype.itemsize for n, x in zip(leaf_names(shapes), jax.tree.leaves(shapes))}
    whole = {n for n, _ in t.steps.zero.replicated()}
    blocks = sum(b for n, b in sizes.items() if n.startswith("blocks.") and n not in whole)
    shared = sum(b for n, b in sizes.items() if not n.startswith("blocks.") and n not in whole)
    ring = (d - 1) / d
    expected = ring * (m * (gathers + 1) * blocks + 2 * shared) + 2 * ring * kept
    assert data == pytest.approx(expected, rel=0.01)


# ---- checkpoints --------------------------------------------------------------------------------------


def assert_same_parameters(a, b):
    """Equal bit for bit, up to the vocabulary's padding (which depends on the tensor-parallel size).
    (A run's result holds its parameters in the model's layer order.)"""

    def same(x, y):
        rows = min(x.shape[0], y.shape[0]) if x.ndim else None
        np.testing.assert_array_equal(x[:rows], y[:rows])

    jax.tree.map(same, jax.device_get(a), jax.device_get(b))


@pytest.mark.slow  # on the second stack: test_checkpoint.py's resumes and restores onto other meshes
def test_zero_runs_resume_bitwise_and_restore_onto_any_mesh_and_level(tmp_path):
    run = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep=5"]
    sharded = trainer(*mesh(8, 1, 1), "parallel.zero=3", *run, f"checkpoint.dir={tmp_path / 'z3'}")
    straight = trainer(*mesh(8, 1, 1), "parallel.zero=3", "train.steps=4").run()
    first = sharded.run()
    assert first.losses == straight.losses  # saving changes nothing

    # zero=3 (8,1,1) -> zero=0 (1,1,8): the same parameters and moments
    replicated = trainer(*mesh(1, 1, 8), *run, f"checkpoint.dir={tmp_path / 'z3'}")
    store = CheckpointStore(tmp_path / "z3", keep=5)
    params, opt_state, position = replicated.restore(store)
    assert position.step == 4
    assert_same_parameters(params, first.params)

    # and back: a zero=0 checkpoint read by zero=1 and zero=3 runs on (2,2,2)
    replicated_run = trainer(*mesh(1, 1, 8), *run, f"checkpoint.dir={tmp_path / 'z0'}").run()
    for zero in ("parallel.zero=1", "parallel.zero=3"):
        other = trainer(*mesh(2, 1, 4), zero, *run, f"checkpoint.dir={tmp_path / 'z0'}")
        params, opt_state, _ = other.restore(CheckpointStore(tmp_path / "z0", keep=5))
        assert_same_parameters(params, replicated_run.params)
        assert any("data" in str(x.sharding.spec) for x in jax.tree.leaves(opt_state.optimizer))

    # pipelined: zero=3 on (2,2,2) interleaved (layers in stage order, split over data) onto other
    # schedules, meshes and levels; 3 steps, the program test_zero_levels_train_like_replicated_state
    # compiled (a cache hit where it ran first), checkpointed at step 2 and at the end
    piped_run = ["train.steps=3", *run[1:]]
    piped = trainer(*mesh(2, 2, 2, "interleaved", 2, 4), "parallel.zero=3", *piped_run,
                    f"checkpoint.dir={tmp_path / 'z3p'}").run()
    for layout, zero in ((mesh(2, 2, 2, "zb-h1", 1, 4), "parallel.zero=1"), (mesh(4, 2, 1, "1f1b", 1, 4), "parallel.zero=3")):
        other = trainer(*layout, zero, *piped_run, f"checkpoint.dir={tmp_path / 'z3p'}")
        params, _, _ = other.restore(CheckpointStore(tmp_path / "z3p", keep=5))
        assert_same_parameters(other.canonical_params(params), piped.params)

    # a zero=1 run killed after its checkpoint resumes bit for bit
    directory = tmp_path / "z1"
    resumable = trainer(*mesh(4, 1, 2), "parallel.zero=1", *run, f"checkpoint.dir={directory}")
    straight = trainer(*mesh(4, 1, 2), "parallel.zero=1", "train.steps=4").run()
    resumable.run()
    for step in (3, 4):
        shutil.rmtree(directory / str(step), ignore_errors=True)
    resumed = trainer(*mesh(4, 1, 2), "parallel.zero=1", *run, f"checkpoint.dir={directory}").run()
    assert resumed.first_step == 3 and resumed.losses == straight.losses[2:]


# ---- no stacked-gradient buffer ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(mesh(1, 4, 2, "1f1b", 1, 8), marks=pytest.mark.extended),
                                    pytest.param(mesh(1, 4, 2, "zb-h1", 1, 8), marks=pytest.mark.extended),
                                    [*mesh(2, 2, 2, "interleaved", 2, 4), "parallel.zero=3"]],
                         ids=["1x4x2-1f1b", "1x4x2-zbh1", "2x2x2-interleaved-zero3"])
def test_the_pipelined_step_holds_no_gradient_buffer_beyond_one_stage(layout):  # CI: 2x2x2 interleaved, zero=3
    """Taking gradients through a whole-program pipeline can build a ``[stages, ...]`` stack of every
    stage's weight gradients on each device. Every buffer of the compiled program shaped like a block
    weight (here ``[..., 48, 40]``: hidden 48, an MLP of 80 split over 2 tensor ranks) holds at most
    the layers of one stage."""
    t, *_ = compiled(*layout, "model.layers=8", "model.hidden=48", "model.mlp_dim=80", "model.heads=4")
    text = t.steps._compiled["train"].as_text()
    shapes = {tuple(int(n) for n in s.split(",")) for s in re.findall(r"f32\[([0-9,]+)\]", text)}
    weights = [s for s in shapes if s[-2:] in ((48, 40), (40, 48))]
    per_stage = 8 // t.mesh.shape["pipe"]
    assert weights and max(math.prod(s[:-2]) for s in weights) <= per_stage, sorted(weights)


@pytest.mark.slow
def test_evaluation_and_generation_read_split_parameters():
    """Held-out loss and greedy tokens from a zero=3 run's parameters (split over data) are those of the
    same parameters held whole."""
    from meshtron.generate import sample

    layout = mesh(4, 1, 2)  # no pipeline: the training layout is the model's (canonical) order
    whole = trainer(*layout, "train.steps=2")
    split = trainer(*layout, "train.steps=2", "parallel.zero=3")
    params = split.run().params
    assert any("data" in str(x.sharding.spec) for x in jax.tree.leaves(params))
    replicated = jax.device_put(jax.device_get(params), whole.steps.param_shardings)
    assert split.evaluate(params) == pytest.approx(whole.evaluate(replicated), rel=1e-6)
    tokens = sample(split.model_def, params, split.mesh, "def ", max_new_tokens=6).new_tokens
    assert tokens == sample(whole.model_def, replicated, whole.mesh, "def ", max_new_tokens=6).new_tokens
