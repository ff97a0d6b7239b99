"""DPO over packed pairs (``data.pairs_per_window`` > 1): several pairs' chosen conversations in one
window and their rejected ones in the matching window, each a document of its own. The step's loss,
gradient and metrics equal those of the same pairs one a window (per-pair losses averaged alike), with
LoRA's frozen base, with a precomputed reference, with a frozen copy of the starting weights, and in a
pipeline; the windows hold every pair once an epoch, whole, and are built the same every time; what
packing cannot run is one line."""

import numpy as np
import pytest
import test_dpo
from test_dpo import dpo_config, full_config, precomputed_trainer

from meshtron.config import MeshConfig
from meshtron.data.preference import PackedPairs, PreferencePairs
from meshtron.errors import ConfigError
from meshtron.pretrained import load_pretrained

case, hf = test_dpo.case, test_dpo.hf  # test_dpo's fixtures: its model and pairs

# Conversations of the test pairs are 39 to 46 tokens: a 96-token window holds exactly 2 pairs, a 129-token
# one 2 or 3.
# (Positions restart at every document; the window itself must fit the model's positions.)
TWO_A_WINDOW = ("model.seq_len=95", "model.max_position_embeddings=128")
TWO_OR_THREE = ("model.seq_len=128", "model.max_position_embeddings=128")


def with_adapters(params, seed=0):
    """``params`` with random LoRA ``b`` matrices, so that the policy is not the reference."""
    import jax

    rng = np.random.default_rng(seed)

    def move(path, leaf):
        if getattr(path[-1], "key", None) == "kernel_lora_b":
            return np.asarray(leaf) + 0.05 * rng.standard_normal(leaf.shape).astype(np.float32)
        return np.asarray(leaf)

    return jax.tree_util.tree_map_with_path(move, jax.device_get(params))


def unpacked_batch(packed: PackedPairs, samples: range) -> np.ndarray:
    """The pairs that window pairs ``samples`` hold, one pair a window pair, in the same order."""
    held = np.concatenate([packed.window_pairs(i) for i in samples])
    return np.concatenate([packed.pair(int(p)) for p in held])


def step_values(trainer, params, batch, reference=None):
    """The step's loss, gradient (model layer order) and metrics at ``params`` (model layer order);
    ``reference``: the frozen copy's weights (model layer order), which the step takes beside ``batch``."""
    import jax

    from meshtron.train.pipelined import to_canonical, to_stage_order

    pipe, chunks = trainer.mesh.shape["pipe"], trainer.cfg.pipeline.chunks
    layers = trainer.model_def.layers

    def held(tree):
        return to_stage_order(tree, layers, pipe, chunks) if pipe > 1 else tree

    weights = jax.device_put(held(params), trainer.steps.param_shardings)
    inputs = trainer.steps.inputs(jax.numpy.asarray(batch), None if reference is None else held(reference))
    loss, grads = trainer.steps.gradients(weights, inputs)
    grads = to_canonical(jax.device_get(grads), layers, pipe, chunks) if pipe > 1 else jax.device_get(grads)
    return float(loss), grads, trainer.steps.objective_metrics(weights, inputs)


def check_same(packed, unpacked, *, trained: str):
    """Packed and unpacked loss within 4e-6 (fp32 sums of log-probabilities near -70, in another order),
    every ``trained`` leaf's gradient within 1e-5 of its largest
    entry, metrics within 1e-5 (or 1e-6 of their size)."""
    import jax

    (loss, grads, metrics), (want, want_grads, want_metrics) = packed, unpacked
    print(f"\npacked DPO loss {loss:.8f}, one pair a window {want:.8f}: |delta| {abs(loss - want):.2e}")
    assert abs(loss - want) <= 4e-6
    assert abs(want - np.log(2.0)) > 1e-3  # the policy is off the reference
    checked = 0
    for (path, have), wanted in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        if getattr(path[-1], "key", None) != trained:
            continue
        wanted = np.asarray(wanted, np.float64)
        error = np.max(np.abs(np.asarray(have, np.float64) - wanted)) / np.max(np.abs(wanted))
        assert error <= 1e-5, (jax.tree_util.keystr(path), error)
        checked += 1
    assert checked
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-5), name


def packed_trainer(cfg):
    from meshtron.train.loop import Trainer

    trainer = Trainer.from_config(cfg)
    assert isinstance(trainer.corpus.train, PackedPairs)
    return trainer


def test_packed_lora_dpo_equals_one_pair_a_window(case, tmp_path):
    """On one device, 4 window pairs of 2 or 3 pairs each (up to 4 slots, the rest masked): the packed
    step's loss, adapters' gradients and metrics equal the unpacked step's over the same pairs."""
    _, imported, data = case
    packed = packed_trainer(dpo_config(imported, data, tmp_path / "p", *TWO_OR_THREE, "data.pairs_per_window=4"))
    held = [len(packed.corpus.train.window_pairs(i)) for i in range(4)]
    assert set(held) == {2, 3}, held  # windows of different fill: the padding slots are masked
    batch = packed.train_stream().global_batch(0)
    assert batch.shape == (8, 129, 3) and set(np.unique(batch[..., 1])) <= {0, 1, 2, 3}
    params = with_adapters(packed.starting_state(None)[0])

    from meshtron.train.loop import Trainer

    plain = Trainer.from_config(dpo_config(imported, data, tmp_path / "u", *TWO_OR_THREE,
                                           f"train.batch_size={sum(held)}"))
    check_same(step_values(packed, params, batch),
               step_values(plain, params, unpacked_batch(packed.corpus.train, range(4))), trained="kernel_lora_b")


# CI runs the context split (the same assertions, each window over 2 ranks); make test one device too
@pytest.mark.parametrize("layout", [pytest.param((), marks=pytest.mark.extended),
                                    pytest.param(("parallel.context=2",), marks=pytest.mark.slow)],
                         ids=["one-device", "context-2"])
def test_packed_full_dpo_with_a_precomputed_reference_equals_one_pair_a_window(case, tmp_path, layout):
    """The whole model against precomputed reference values, each position of a packed window carrying its
    own conversation's: the same loss, gradient and metrics as one pair a window (on one device), also
    with each window split over 2 context ranks (a conversation's sums, and its reference, taken over
    them)."""
    _, imported, data = case
    cfg = full_config(imported, data, tmp_path / "p", *TWO_OR_THREE, "data.pairs_per_window=4", *layout)
    starting = load_pretrained(imported, MeshConfig(1, 1, 1)).params
    packed = precomputed_trainer(cfg, starting)
    pairs = packed.corpus.train
    batch = packed.train_stream().global_batch(0)
    assert batch.shape == (8, 129, 4)
    first = pairs.window_pairs(0)
    for segment, pair in enumerate(first.tolist(), 1):  # each document carries its own pair's values
        for row in range(2):
            bits = batch[row, batch[row, :, 1] == segment, 3]
            assert set(bits.tolist()) == {int(pairs.reference[pair, row:row + 1].view(np.int32)[0])}
    import jax

    # the starting weights' matrices scaled, so that the policy is off the reference
    params = jax.tree.map(lambda x: np.asarray(x) * np.float32(1.05 if x.ndim == 3 else 1.0), starting)
    from meshtron.train.loop import Trainer

    held = sum(len(pairs.window_pairs(i)) for i in range(4))
    plain = Trainer.from_config(full_config(imported, data, tmp_path / "u", *TWO_OR_THREE,
                                            f"train.batch_size={held}"))
    check_same(step_values(packed, params, batch), step_values(plain, params, unpacked_batch(pairs, range(4))),
               trained="kernel")


# CI runs the pipeline (the same assertions on 2 stages); make test one device too
@pytest.mark.parametrize("layout", [pytest.param((), marks=pytest.mark.extended),
                                    pytest.param(("parallel.pipe=2", "parallel.schedule=1f1b",
                                                      "parallel.microbatches=2"), marks=pytest.mark.slow)],
                         ids=["one-device", "pipe-1f1b"])
def test_packed_full_dpo_with_a_frozen_copy_equals_one_pair_a_window(case, tmp_path, layout):
    """The frozen copy of the starting weights, its forward inside the step, sums each conversation of a
    packed window apart and writes each sum onto its own conversation's positions: the step's loss, gradient
    and metrics equal the frozen copy's one pair a window on one device over the same pairs, also in a
    pipeline of 2 stages under 1F1B (the copy's per-document sums from the forward-only schedule's last
    stage), 2 microbatches of 2 window pairs of 2 pairs each (a third slot masked)."""
    import jax

    from meshtron.train.loop import Trainer

    _, imported, data = case
    packed = packed_trainer(full_config(imported, data, tmp_path / "p", *TWO_A_WINDOW, "data.pairs_per_window=3",
                                        *layout, precompute=False))
    pairs = packed.corpus.train
    assert [len(pairs.window_pairs(i)) for i in range(4)] == [2, 2, 2, 2]
    batch = packed.train_stream().global_batch(0)
    assert batch.shape == (8, 96, 3)  # the step adds the copy's values itself
    starting = load_pretrained(imported, MeshConfig(1, 1, 1)).params
    params = jax.tree.map(lambda x: np.asarray(x) * np.float32(1.05 if x.ndim == 3 else 1.0), starting)
    plain = Trainer.from_config(full_config(imported, data, tmp_path / "u", *TWO_A_WINDOW, "train.batch_size=8",
                                            precompute=False))
    check_same(step_values(packed, params, batch, starting),
               step_values(plain, params, unpacked_batch(pairs, range(4)), starting), trained="kernel")


@pytest.mark.slow
def test_packed_lora_dpo_in_a_pipeline_equals_one_pair_a_window(case, tmp_path):
    """(data, pipe, tensor) = (2, 2, 2), interleaved (2 chunks a stage), 2 microbatches: each microbatch
    of each data shard one window pair of 2 pairs and a masked third slot, its rows doubled for the frozen
    base at the last stage; the step's loss, gradients and metrics equal one device's over the same pairs
    one a window."""
    from meshtron.train.loop import Trainer

    _, imported, data = case
    layout = ("parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.schedule=interleaved",
              "parallel.chunks=2", "parallel.microbatches=2")
    packed = packed_trainer(dpo_config(imported, data, tmp_path / "p", *TWO_A_WINDOW, "data.pairs_per_window=3",
                                       *layout))
    assert [len(packed.corpus.train.window_pairs(i)) for i in range(4)] == [2, 2, 2, 2]
    params = with_adapters(Trainer.from_config(dpo_config(imported, data, tmp_path / "s")).starting_state(None)[0])
    plain = Trainer.from_config(dpo_config(imported, data, tmp_path / "u", *TWO_A_WINDOW, "train.batch_size=8"))
    check_same(step_values(packed, params, packed.train_stream().global_batch(0)),
               step_values(plain, params, unpacked_batch(packed.corpus.train, range(4))), trained="kernel_lora_b")


def test_windows_hold_every_pair_once_an_epoch_whole_and_the_same_every_time(case):
    """Each epoch's window pairs hold every pair of the split once; a window pair's two rows are its pairs'
    chosen and rejected conversations, in the same order under the same segment ids, exactly as one pair a
    window holds them; a second reader builds the same windows; a pair that does not fit starts the next."""
    _, _, data = case
    one = PreferencePairs(data, seq_len=127, seed=3, holdout_fraction=0.25)
    packed = PackedPairs(data, seq_len=127, seed=3, holdout_fraction=0.25, num_samples=40, pairs_per_window=4)
    again = PackedPairs(data, seq_len=127, seed=3, holdout_fraction=0.25, num_samples=40, pairs_per_window=4)
    first_epoch = packed.samples_per_epoch
    assert first_epoch < one.num_pairs  # fewer windows than pairs
    seen = np.concatenate([packed.window_pairs(i) for i in range(first_epoch)])
    assert sorted(seen.tolist()) == list(range(one.num_pairs))
    for i in range(first_epoch):
        window, held = packed.sample(i), packed.window_pairs(i)
        np.testing.assert_array_equal(window, again.sample(i))
        for segment, pair in enumerate(held.tolist(), 1):
            alone = one.pair(pair)
            for row in range(2):
                mine = window[row, window[row, :, 1] == segment]
                length = int(np.count_nonzero(alone[row, :, 1]))
                np.testing.assert_array_equal(mine[:, [0, 2]], alone[row, :length][:, [0, 2]])
        if i + 1 < first_epoch:  # the next window's first pair did not fit in this one (either row, or 4 held)
            nxt = packed.window_pairs(i + 1)[0]
            lengths = packed._fits
            fits = all(lengths[held, k].sum() + lengths[nxt, k] <= 128 for k in range(2))
            assert len(held) == 4 or not fits
    second = np.concatenate([packed.window_pairs(first_epoch + i) for i in range(packed._windows.locate(39)[1])])
    assert len(set(second.tolist())) == len(second)  # the next epoch draws each pair once again


def test_packing_runs_with_a_frozen_copy(case, tmp_path):
    """The whole model against a frozen copy of its starting weights packs pairs (nothing refused)."""
    from meshtron.run import check_features

    _, imported, data = case
    check_features(full_config(imported, data, tmp_path / "x", "data.pairs_per_window=2", precompute=False))


def test_packing_needs_an_indexed_dataset(case, tmp_path):
    from meshtron.run import check_features

    _, imported, data = case
    cfg = dpo_config(imported, data, tmp_path / "x", "data.pairs_per_window=2")
    cfg.data.source = "hf"
    with pytest.raises(ConfigError, match=r"data.pairs_per_window: packs the pairs of an indexed dataset, and "
                                          r"data.source=hf streams them"):
        check_features(cfg)


@pytest.mark.slow
def test_a_packed_run_trains_logs_and_resumes(case, tmp_path):
    """``meshtron train``'s path end to end on packed pairs with a precomputed reference: the first step's
    loss is log 2 (the policy is its reference) with TRL's metrics beside it, and a resumed run reads the
    saved reference values and draws the same window pairs from where it stopped."""
    import json

    from meshtron.train.loop import Trainer

    _, imported, data = case
    args = (*TWO_OR_THREE, "data.pairs_per_window=4")
    cfg = full_config(imported, data, tmp_path / "run", *args)
    with open(tmp_path / "metrics.jsonl", "w") as metrics:
        Trainer.from_config(cfg).run(metrics_file=metrics)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "rewards/margins" in r]
    assert len(steps) == 2 and steps[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-5)
    assert steps[1]["loss"] < steps[0]["loss"]
    longer = full_config(imported, data, tmp_path / "run", *args, "train.steps=3")
    resumed = Trainer.from_config(longer)
    with open(tmp_path / "more.jsonl", "w") as metrics:
        resumed.run(metrics_file=metrics)
    more = [json.loads(line) for line in (tmp_path / "more.jsonl").read_text().splitlines()]
    assert [r["step"] for r in more if "rewards/margins" in r] == [3]  # resumed after step 2
    assert resumed.corpus.train.reference is not None  # read from the run's directory (a resumed run computes none)
    fresh = PackedPairs(data, seq_len=128, seed=cfg.train.seed, holdout_fraction=0.25, num_samples=40,
                        pairs_per_window=4)
    np.testing.assert_array_equal(resumed.train_stream().global_batch(2)[..., :3],
                                  np.stack([fresh.sample(8 + i)[k] for i in range(4) for k in range(2)]))


@pytest.mark.slow
def test_packed_full_dpo_in_a_pipeline_with_a_precomputed_reference_equals_one_pair_a_window(case, tmp_path):
    """2 stages under 1F1B, 2 microbatches of 2 window pairs of 2 pairs each (a third slot masked): the last
    stage reads each conversation's precomputed reference from its own positions; the step's loss, gradient
    and metrics equal one device's over the same pairs one a window."""
    import jax

    from meshtron.train.loop import Trainer

    _, imported, data = case
    cfg = full_config(imported, data, tmp_path / "p", *TWO_A_WINDOW, "data.pairs_per_window=3", "parallel.pipe=2",
                      "parallel.schedule=1f1b", "parallel.microbatches=2")
    starting = load_pretrained(imported, MeshConfig(1, 1, 1)).params
    packed = precomputed_trainer(cfg, test_dpo.stage_ordered(cfg, starting))
    pairs = packed.corpus.train
    assert [len(pairs.window_pairs(i)) for i in range(4)] == [2, 2, 2, 2]
    params = jax.tree.map(lambda x: np.asarray(x) * np.float32(1.05 if x.ndim == 3 else 1.0), starting)
    plain = Trainer.from_config(full_config(imported, data, tmp_path / "u", *TWO_A_WINDOW, "train.batch_size=8"))
    check_same(step_values(packed, params, packed.train_stream().global_batch(0)),
               step_values(plain, params, unpacked_batch(pairs, range(4))), trained="kernel")


def test_pipelined_metrics_average_each_microbatchs_real_pairs():
    """A pipeline's DPO metrics of packed pairs (from the last stage's per-document sums) are each
    microbatch's means over its real pairs, averaged over the microbatches, as outside a pipeline: here
    one microbatch holds 1 pair and the other 3, so the mean over the batch's 4 pairs would differ."""
    import jax.numpy as jnp

    from meshtron.models.documents import document_features
    from meshtron.models.preference import PreferenceLoss
    from meshtron.train.objective import Preference

    beta, slots, window = 0.5, 3, 12
    rng = np.random.default_rng(0)

    def window_pair(held: int, reference: np.ndarray) -> np.ndarray:
        """Two rows [window + 1, 4] of ``held`` conversations of 4 tokens (the last 2 counted) each."""
        out = np.zeros((2, window + 1, 4), np.int32)
        for row in range(2):
            for j in range(held):
                at = slice(4 * j, 4 * j + 4)
                out[row, at, 0] = rng.integers(1, 50, 4)
                out[row, at, 1] = j + 1
                out[row, at, 2] = [0, 0, 1, 1]
                out[row, at, 3] = np.float32(reference[j, row]).view(np.int32)
        return out

    held = (1, 3)
    references = [rng.normal(-20, 3, (slots, 2)).astype(np.float32) for _ in held]
    tokens = np.stack([np.asarray(document_features(jnp.asarray(window_pair(h, r)))) for h, r in zip(held, references)])
    rows = rng.normal(-20, 3, (len(held), 2, slots)).astype(np.float32)  # [m, rows, K]: policy sums

    found = Preference(PreferenceLoss(beta), carried=True, packed=slots).head_metrics(jnp.asarray(rows),
                                                                                      jnp.asarray(tokens))
    per_microbatch = []
    for m, h in enumerate(held):
        chosen = beta * (rows[m, 0, :h] - references[m][:h, 0])
        rejected = beta * (rows[m, 1, :h] - references[m][:h, 1])
        per_microbatch.append({"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                               "rewards/accuracies": (chosen > rejected).mean(),
                               "rewards/margins": (chosen - rejected).mean(), "logps/chosen": rows[m, 0, :h].mean(),
                               "logps/rejected": rows[m, 1, :h].mean()})
    for name, values in found.items():
        want = np.mean([mb[name] for mb in per_microbatch])
        assert float(values) == pytest.approx(want, rel=1e-5, abs=1e-5), name
