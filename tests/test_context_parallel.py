"""Context parallelism: sequences split over the ``context`` mesh axis. The loss and every gradient
equal one device's on data x pipeline x context x tensor layouts, for GPT, Llama (grouped-query) and
a user's model, with either exchange; training, ZeRO and 1-bit LAMB reduce over data x context;
checkpoints restore onto meshes without the split; bad settings are one line."""

import re
import shutil
from dataclasses import replace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshtron.checkpoint import CheckpointStore
from meshtron.config import ConfigError, MeshConfig, ModelConfig, load_config
from meshtron.hlo.collectives import collectives
from meshtron.models.blocks import Context
from meshtron.sharding import MEGATRON_RULES, extend_rules
from meshtron.testing import Layout, ParityError, check_parity
from meshtron.train.data_shards import context_layout
from meshtron.train.loop import Trainer
from meshtron.train.state import ModelDef, model_def_from_config

SEQ = 32  # divisible by 2 x 8 context ranks


def family(name: str, tensor: int = 1) -> ModelDef:
    from families import small

    return small(name, SEQ, tensor)


# (data, pipe, context, tensor) as the issue names them; a Layout is (data, pipe, tensor, ...).
# zb-h1 at m = p = 2 (m = 2p compiled twice the ticks): B and W still split, stage 1's W deferred past
# its next B; zb-h1's steady state at m = 2p: tests/test_pipeline.py's every-schedule grid.
LAYOUTS = {
    "1x1x8x1-gathered": Layout(1, 1, 1, context=8),
    "1x1x8x1-ring": Layout(1, 1, 1, context=8, context_attention="ring"),
    "2x1x2x2-gathered": Layout(2, 1, 2, context=2),
    "2x1x2x2-ring": Layout(2, 1, 2, context=2, context_attention="ring"),
    "1x2x2x2-interleaved": Layout(1, 2, 2, "interleaved", 2, context=2),
    "1x2x2x2-interleaved-ring": Layout(1, 2, 2, "interleaved", 2, context=2, context_attention="ring"),
    "1x2x4x1-zbh1": Layout(1, 2, 1, "zb-h1", microbatches=2, context=4),
    "1x2x4x1-zbh1-ring": Layout(1, 2, 1, "zb-h1", microbatches=2, context=4, context_attention="ring"),
}
FAST = {("llama", "2x1x2x2-ring"), ("gpt", "1x2x4x1-zbh1"), ("user", "1x1x8x1-gathered"),
        ("llama", "1x2x4x1-zbh1-ring")}


def _marks(name: str, key: str) -> tuple[str, ...]:
    """The names of the tiers one family's layout runs in. CI runs every layout on the Llama (grouped-query
    attention, rotary positions) and one on each other family; the other families' further layouts are
    ``extended``."""
    marks = () if (name, key) in FAST else ("slow",) if name == "llama" else ("slow", "extended")
    if (name, key) in {("llama", "2x1x2x2-ring"), ("llama", "1x2x2x2-interleaved"), ("llama", "1x2x2x2-interleaved-ring")}:
        marks += ("both_stacks",)
    return marks


def _params():
    """One case per family, tensor size and tier: the oracle runs the one-device reference once and
    compares every layout of the case with it (the batch, 8 rows, is the same for every layout)."""
    for name in ("gpt", "llama", "user"):
        groups: dict[tuple, list[str]] = {}
        for key, layout in LAYOUTS.items():
            groups.setdefault((layout.tensor, _marks(name, key)), []).append(key)
        for (_, marks), keys in groups.items():
            yield pytest.param(name, keys, id=f"{name}-{'+'.join(keys)}", marks=[getattr(pytest.mark, m) for m in marks])


# The all-to-all exchanges split each tensor rank's query heads over the ranks they join: 8 heads (of 4
# dimensions), which 8 context ranks split; Llama's 2 key/value heads are fewer than the ranks (repeated).
ULYSSES = {
    "1x1x8x1-ulysses": Layout(1, 1, 1, context=8, context_attention="ulysses"),
    "2x1x2x2-ulysses": Layout(2, 1, 2, context=2, context_attention="ulysses"),
    "1x2x2x2-interleaved-ulysses": Layout(1, 2, 2, "interleaved", 2, context=2, context_attention="ulysses"),
    "1x2x4x1-zbh1-ulysses": Layout(1, 2, 1, "zb-h1", microbatches=2, context=4, context_attention="ulysses"),
    "1x1x8x1-hybrid-u2": Layout(1, 1, 1, context=8, context_attention="hybrid", ulysses_degree=2),
    "1x1x8x1-hybrid-u4": Layout(1, 1, 1, context=8, context_attention="hybrid", ulysses_degree=4),
}
# (data x tensor with Ulysses runs fast in tests/test_packed_documents.py, with packed documents)
ULYSSES_FAST = {("llama", "1x2x4x1-zbh1-ulysses"), ("user", "1x1x8x1-hybrid-u4")}


def _ulysses_params():
    """As :func:`_params`, for the all-to-all exchanges' layouts (the same tiers)."""
    for name in ("gpt", "llama", "user"):
        groups: dict[tuple, list[str]] = {}
        for key, layout in ULYSSES.items():
            groups.setdefault((layout.tensor, (name, key) in ULYSSES_FAST), []).append(key)
        for (_, fast), keys in groups.items():
            marks = [] if fast else [pytest.mark.slow] if name == "llama" else [pytest.mark.slow, pytest.mark.extended]
            yield pytest.param(name, keys, id=f"{name}-{'+'.join(keys)}", marks=marks)


@pytest.mark.parametrize("name, keys", list(_ulysses_params()))
def test_ulysses_and_hybrid_loss_and_gradients_equal_one_device(name, keys, monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    from families import small

    layouts = [ULYSSES[key] for key in keys]
    reports = check_parity(small(name, SEQ, layouts[0].tensor, heads=8), layouts, seq_len=SEQ)
    assert len(reports) == len(keys)
    for report in reports:
        assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6), report


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["selective", pytest.param("full", marks=pytest.mark.extended)])
def test_ulysses_and_hybrid_under_recomputation_keep_parity(remat, monkeypatch):
    """The all-to-alls rerun with the attention core (selective) or the block (full) in the backward."""
    from meshtron.execution import Execution

    monkeypatch.syspath_prepend("tests/models")
    from families import small

    layouts = [Layout(2, 1, 2, context=2, context_attention="ulysses"),
               Layout(1, 1, 2, context=4, context_attention="hybrid", ulysses_degree=2)]
    for report in check_parity(small("llama", SEQ, 2, heads=8), layouts, seq_len=SEQ, execution=Execution(remat=remat)):
        assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6), report


@pytest.mark.parametrize("name, keys", list(_params()))
def test_loss_and_gradients_equal_one_device(name, keys, monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    layouts = [LAYOUTS[key] for key in keys]
    reports = check_parity(family(name, layouts[0].tensor), layouts, seq_len=SEQ)
    assert len(reports) == len(keys)
    for report in reports:
        assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6), report


def test_a_model_that_slices_positions_from_the_first_is_caught_by_the_oracle(monkeypatch):
    """The contract's positions are not contiguous on a context rank: a model that slices its position
    table from the first position (instead of looking each one up) gets wrong positions, and the
    oracle says so."""
    monkeypatch.syspath_prepend("tests/models")
    import parallel_lm

    class SlicingLM(parallel_lm.ParallelLM):
        def embed(self, tokens, ctx):
            ctx = Context(jax.numpy.broadcast_to(ctx.positions[:, :1] + jax.numpy.arange(tokens.shape[1]),
                                                 ctx.positions.shape))
            return super().embed(tokens, ctx)

    md = ModelDef.create(lambda r: SlicingLM(64, 32, 4, 64, 4, SEQ, rngs=r),
                         rules=extend_rules(MEGATRON_RULES, parallel_lm.RULES))
    [report] = check_parity(md, [Layout(1, 1, 1, context=4)], seq_len=SEQ, raise_on_mismatch=False)
    assert not report.ok


def multi_query_model(kv_heads: int = 1) -> ModelDef:
    """A user's model whose key/value heads have a name of their own (``kv_pair``) that the rules keep
    whole on every tensor rank, while its query heads split over them: multi-query attention with one
    head, or any count the tensor size does not divide."""
    import parallel_lm
    from flax import nnx

    from meshtron.models import attention, blocks
    from meshtron.sharding import constrain

    class MultiQueryBlock(parallel_lm.ParallelBlock):
        def __init__(self, hidden: int, heads: int, ffn: int, *, rngs: nnx.Rngs):
            super().__init__(hidden, heads, ffn, rngs=rngs)
            self.wk, self.wv = (parallel_lm._param(rngs, (hidden, kv_heads, hidden // heads),
                                                   ("embed", "kv_pair", "attn_dim")) for _ in range(2))

        def __call__(self, x, ctx):
            h = blocks.enter_parallel_region(self.norm(x))
            q = constrain(jax.numpy.einsum("bse,ehd->bshd", h, self.wq[...]), ("batch", "seq", "attn_heads", "attn_dim"))
            k, v = (constrain(jax.numpy.einsum("bse,ehd->bshd", h, w[...]), ("batch", "seq", "kv_pair", "attn_dim"))
                    for w in (self.wk, self.wv))
            out = jax.numpy.einsum("bshd,hde->bse", attention.causal_attention(q, k, v), self.wo[...])
            return constrain(x + blocks.exit_parallel_region(out), blocks.RESIDUAL)

    class MultiQueryLM(parallel_lm.ParallelLM):
        def __init__(self, *, rngs: nnx.Rngs):
            super().__init__(64, 32, 4, 64, 2, SEQ, rngs=rngs)
            self.blocks = blocks.stack_blocks(lambda r: MultiQueryBlock(32, 4, 64, rngs=r), 2, rngs)

    return ModelDef.create(lambda r: MultiQueryLM(rngs=r),
                           rules=extend_rules(MEGATRON_RULES, {**parallel_lm.RULES, "kv_pair": None}))


@pytest.mark.parametrize("exchange", ["gathered", "ulysses", pytest.param("ring", marks=pytest.mark.slow)])
def test_key_value_heads_kept_whole_on_every_tensor_rank_keep_parity(exchange, monkeypatch):
    """The gathered exchange keeps keys and values as the model laid them out: here whole on both
    tensor ranks (one head, which two ranks cannot split), each device gathering all of them. Ulysses's
    all-to-all sends each device's own: the key/value head its query heads read."""
    monkeypatch.syspath_prepend("tests/models")
    [report] = check_parity(multi_query_model(), [Layout(1, 1, 2, context=2, context_attention=exchange)],
                            seq_len=SEQ)
    assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6)


def test_a_layout_that_fails_to_run_is_one_line_in_the_oracle_s_report(monkeypatch):
    """A layout whose program does not build is a failed parity naming the layout and the error, raised
    or reported, not the traceback of the model's code."""
    monkeypatch.syspath_prepend("tests/models")
    import parallel_lm

    class WholeSequenceLM(parallel_lm.ParallelLM):
        def embed(self, tokens, ctx):
            if tokens.shape[1] != SEQ:
                raise ValueError(f"embed: expected {SEQ} tokens, got {tokens.shape[1]}\n(a second line)")
            return super().embed(tokens, ctx)

    md = ModelDef.create(lambda r: WholeSequenceLM(64, 32, 4, 64, 2, SEQ, rngs=r),
                         rules=extend_rules(MEGATRON_RULES, parallel_lm.RULES))
    line = f"1x1x1 context=2 gathered: failed to run: ValueError: embed: expected {SEQ} tokens, got {SEQ // 2}"
    with pytest.raises(ParityError, match=f"^{line}$") as raised:
        check_parity(md, [Layout(1, 1, 1, context=2)], seq_len=SEQ)
    assert isinstance(raised.value.__context__, ValueError)  # the traceback, for whoever debugs the model
    [report] = check_parity(md, [Layout(1, 1, 1, context=2)], seq_len=SEQ, raise_on_mismatch=False)
    assert not report.ok and report.error == line and np.isnan(report.loss)


def test_the_step_lays_tokens_out_as_each_rank_s_front_and_mirrored_back_chunk():
    tokens = np.arange(17)[None]  # 16 inputs, each with the token it predicts
    pairs = np.asarray(context_layout(jax.numpy.asarray(tokens), 2))
    assert pairs.shape == (1, 16, 2)
    # rank 0: chunks 0 and 3 of 4; rank 1: chunks 1 and 2
    assert pairs[0, :, 0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert (pairs[0, :, 1] == pairs[0, :, 0] + 1).all()
    # Ulysses: the sequence in order (each rank a contiguous quarter); the hybrid of 2 x 2: the ring's
    # balanced halves, each split over the two ranks of its all-to-all
    assert np.asarray(context_layout(jax.numpy.asarray(tokens), 4, 4))[0, :, 0].tolist() == list(range(16))
    hybrid = np.asarray(context_layout(jax.numpy.asarray(tokens), 4, 2))[0, :, 0]
    assert hybrid.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]


# ---- training: the gradient group is data x context -------------------------------------------------

MODEL = ["model.family=llama", "model.kv_heads=2", "model.layers=4", "model.hidden=32", "model.heads=4",
         "model.mlp_dim=64", "model.seq_len=32", "train.batch_size=8", "train.warmup_steps=1",
         "train.eval_every=1000", "train.eval_batches=1", "parallel.microbatches=2"]


def trainer(data, pipe, context, tensor, *overrides, **kwargs) -> Trainer:
    layout = [f"parallel.data={data}", f"parallel.pipe={pipe}", f"parallel.context={context}", f"parallel.tensor={tensor}"]
    return Trainer.from_config(load_config(None, [*MODEL, *layout, *overrides]), **kwargs)


@pytest.mark.slow
def test_context_parallel_training_equals_data_parallel_training_at_every_zero_level():
    reference = trainer(2, 1, 1, 1, "train.steps=3").run()
    # each exchange (gathered, ring) and each zero level once: the exchange runs inside attention, the
    # zero level decides where parameters and optimizer state live, and neither reads the other
    for overrides in ([], ["parallel.context_attention=ring", "parallel.zero=1"], ["parallel.zero=3"]):
        t = trainer(2, 1, 2, 2, "train.steps=3", *overrides)
        if overrides[:1] == ["parallel.zero=3"]:  # parameters split over the whole gradient group
            specs = {str(s.spec) for s in jax.tree.leaves(t.steps.param_shardings)}
            assert any("('data', 'context')" in s for s in specs), specs
        result = t.run()
        np.testing.assert_allclose(result.losses, reference.losses, rtol=2e-5, err_msg=str(overrides))
        jax.tree.map(lambda a, b, o=overrides: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6, err_msg=str(o)),
                     jax.device_get(result.params), jax.device_get(reference.params))
        assert result.heldout_loss == pytest.approx(reference.heldout_loss, rel=1e-5)


@pytest.mark.slow
@pytest.mark.extended  # every zero level with an exchange: the test above, in CI
def test_ulysses_training_at_every_zero_level_equals_data_parallel_training():
    # DeepSpeed's most-reported long-context failures are Ulysses under ZeRO-3: parameters split over data x
    # context and gathered per layer, attention's all-to-alls over context in between; then the optimizer
    # state alone split (zero=1), and zero=3's parameters gathered once per step instead of per layer
    reference = trainer(2, 1, 1, 1, "train.steps=3").run()
    for overrides in (["parallel.zero=3"], ["parallel.zero=1"], ["parallel.zero=3", "parallel.gather_once=true"]):
        result = trainer(2, 1, 2, 2, "train.steps=3", "parallel.context_attention=ulysses", *overrides).run()
        np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-5, err_msg=str(overrides))
        jax.tree.map(lambda a, b, o=overrides: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6, err_msg=str(o)),
                     jax.device_get(result.params), jax.device_get(reference.params))


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["gathered", pytest.param("ulysses", marks=pytest.mark.extended)])
def test_onebit_lamb_compresses_over_data_and_context_together(exchange):
    steps = ["train.optimizer=onebit_lamb", "optim.freeze_step=2", "train.steps=3"]
    split = trainer(2, 1, 2, 1, *steps, f"parallel.context_attention={exchange}")
    reference = trainer(2, 1, 1, 1, *steps).run()
    result = split.run()
    # the warmup (uncompressed LAMB) equals data parallelism's; compression then runs over 4 workers
    np.testing.assert_allclose(result.losses[:2], reference.losses[:2], rtol=2e-5)
    assert np.isfinite(result.losses).all()
    compressed = split.steps._compiled["compression"]
    over = {(c.kind, frozenset(c.axes)) for c in collectives(compressed, split.mesh)}
    assert ("all-to-all", frozenset({"data", "context"})) in over, over
    errors = [s.spec for s in jax.tree.leaves(split.steps.opt_shardings) if s.spec[:1] == P(("data", "context"))[:1]]
    assert errors, "1-bit LAMB's error buffers are per worker of data x context"


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["gathered", "ulysses"])
def test_checkpoints_resume_bitwise_and_restore_without_the_split(exchange, tmp_path):
    run = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep=5", f"checkpoint.dir={tmp_path}",
           f"parallel.context_attention={exchange}"]
    saving = trainer(1, 2, 2, 2, *run)
    # the uninterrupted reference: the same trainer (compiled steps shared) with checkpointing off
    straight = replace(saving, resolved=replace(saving.resolved, cfg=replace(
        saving.cfg, checkpoint=replace(saving.cfg.checkpoint, dir=None)))).run()
    first = saving.run()
    assert first.losses == straight.losses
    for step in (3, 4):
        shutil.rmtree(tmp_path / str(step), ignore_errors=True)
    resumed = trainer(1, 2, 2, 2, *run).run()
    assert resumed.first_step == 3 and resumed.losses == straight.losses[2:]
    # onto a mesh that does not split sequences, and (Ulysses's) onto the ring: the same canonical parameters
    others = [trainer(2, 1, 1, 2, *run[:-1])]
    if exchange == "ulysses":
        others.append(trainer(1, 1, 4, 2, *run[:-1], "parallel.context_attention=ring"))
    for other in others:
        params, _, position = other.restore(CheckpointStore(tmp_path, keep=5))
        assert position.step == 4
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(other.canonical_params(params)),
                     jax.device_get(first.params))


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["gathered", pytest.param("ulysses", marks=pytest.mark.extended)])
def test_generation_from_a_context_parallel_checkpoint_drops_the_split(exchange, tmp_path):
    from meshtron.generate import sample
    from meshtron.pretrained import load_pretrained

    context = 4 if exchange == "gathered" else 2  # Ulysses: 2 query heads per tensor rank split over 2 ranks
    trainer(1, 1, context, 2, "train.steps=1", "checkpoint.every=1", f"checkpoint.dir={tmp_path}",
            f"parallel.context_attention={exchange}").run()
    model = load_pretrained(tmp_path)
    assert model.mesh.shape["context"] == 1 and model.mesh.shape["tensor"] == 2
    assert sample(model, "ab", max_new_tokens=4, temperature=0).text
    with pytest.raises(ConfigError, match=r"^parallel.context: generation does not split sequences"):
        load_pretrained(tmp_path, MeshConfig(1, 1, 2, context=2))


# ---- bad settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["parallel.context=4", "model.seq_len=20"],
     "parallel.context: model.seq_len=20 must be divisible by 2 x parallel.context = 8"),
    (["parallel.context=2", "parallel.pipe=2", "model.layers=4", "parallel.context_attention=ring", "parallel.layout=[1,3]",
      "parallel.microbatches=2", "train.batch_size=8"],
     "parallel.context_attention: ring runs pipeline stages in lockstep"),
    (["parallel.context_attention=a2a"], "parallel.context_attention: must be one of gathered, ring, ulysses, hybrid"),
    (["parallel.context=8", "model.heads=4", "parallel.context_attention=ulysses"],
     ("parallel.context_attention: ulysses splits the 4 query heads of each tensor rank over parallel.context=8 "
     "ranks, which must divide them; use parallel.context_attention=hybrid with a parallel.ulysses_degree")),
    (["parallel.context=8", "parallel.context_attention=hybrid", "parallel.ulysses_degree=3"],
     "parallel.ulysses_degree: the hybrid exchange needs 1 < parallel.ulysses_degree < parallel.context=8, dividing it"),
    (["parallel.context=8", "parallel.context_attention=hybrid", "parallel.ulysses_degree=8", "model.heads=8"],
     "parallel.ulysses_degree: the hybrid exchange needs 1 < parallel.ulysses_degree < parallel.context=8"),
    (["parallel.context=4", "parallel.tensor=2", "model.heads=6", "model.hidden=96", "parallel.context_attention=hybrid",
      "parallel.ulysses_degree=2"],
     ("parallel.ulysses_degree: 2 must divide the 3 query heads of each tensor rank (the all-to-all splits them); use "
     "a divisor of 3 that divides parallel.context=4")),
    (["parallel.context=2", "parallel.ulysses_degree=2"],
     ("parallel.ulysses_degree: 2 sets the hybrid exchange's all-to-all ranks, and this run has "
     "parallel.context_attention=gathered")),
    (["model.ulysses_degree=0"], "parallel.ulysses_degree: must be a whole number >= 1"),
    (["parallel.context=2", "parallel.pipe=2", "model.layers=4", "parallel.context_attention=hybrid",
      "parallel.context=4", "parallel.ulysses_degree=2", "parallel.layout=[1,3]", "parallel.microbatches=2",
      "train.batch_size=8"], "parallel.context_attention: ring runs pipeline stages in lockstep"),
    (["parallel.context=2", "model.family=llama", "model.moe.experts=4"],
     "parallel.context: a mixture of experts is split over data ranks only"),
    (["parallel.context=0"], "parallel.context: must be a positive size or -1"),
    (["model.rules={seq: sequence}"], "model.rules.seq: 'sequence' is not a mesh axis; use data, pipe, context"),
])
def test_bad_context_settings_are_one_line(overrides, message):
    from meshtron.run import resolve_run

    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        cfg = load_config(None, ["parallel.data=1", *overrides])
        resolve_run(cfg, 8)


# ---- what describe says, against the compiled step ---------------------------------------------------


@pytest.mark.parametrize("exchange, remat, mesh", [
    ("gathered", "none", ["parallel.data=2", "parallel.context=2", "parallel.tensor=2"]),  # kv heads split over tensor
    ("ring", "selective", ["parallel.data=1", "parallel.context=4", "parallel.tensor=2"]),
    pytest.param("gathered", "full", ["parallel.data=1", "parallel.context=8", "parallel.tensor=1"], marks=pytest.mark.slow),
])
def test_describe_prints_the_exchange_per_layer_and_microbatch_and_the_compiled_step_agrees(exchange, remat, mesh):
    import io

    from meshtron.describe import describe
    from meshtron.models.context_attention import exchange_bytes
    from meshtron.units import format_bytes

    out = io.StringIO()
    cfg = load_config(None, [*MODEL, *mesh, "parallel.pipe=1", f"parallel.context_attention={exchange}",
                             f"model.remat={remat}"])
    describe(cfg, out)
    text = out.getvalue()
    ranks, tensor = cfg.mesh.context, cfg.mesh.tensor
    tokens = 8 // cfg.mesh.data // 2 * SEQ // ranks  # rows per microbatch x the rank's share of the sequence
    forward, backward = exchange_bytes(exchange, ranks, tokens, kv_heads=2 // tensor, head_dim=8)
    per_layer = forward * (1 + (remat != "none")) + backward
    assert f"{format_bytes(per_layer)} per device, layer and microbatch" in text
    assert (f"{exchange} exchange over context: {format_bytes(per_layer)} per layer and microbatch in the compiled "
            f"step, {format_bytes(per_layer)} by the formula (+0.0%)") in text
    # the step memory model counts a rank's share of the sequence (and, gathered, every key); on these
    # 32-token toy models it is within 30% of the compiled peak (docs/memory.md: small models)
    error = float(re.search(r"\(([-+][\d.]+)% against the compiled peak\)", text)[1])
    assert abs(error) <= 30, f"modelled peak {error:+.1f}% off the compiled one"


@pytest.mark.parametrize("exchange, mesh, kv_heads, heads", [
    ("ulysses", ["parallel.data=2", "parallel.context=4", "parallel.tensor=1"], 2, 4),  # 2 kv heads repeated to 4
    # 8 query heads, 2 per tensor rank, reading 2 key/value heads that 4 tensor ranks keep whole: each device
    # sends its own one (repeated to the 2 ranks of the all-to-all), not both
    ("ulysses", ["parallel.data=1", "parallel.context=2", "parallel.tensor=4", "model.heads=8"], 1, 2),
    pytest.param("hybrid", ["parallel.data=1", "parallel.context=4", "parallel.tensor=2", "parallel.ulysses_degree=2"],
                 1, 2, marks=pytest.mark.slow),
])
def test_describe_prices_the_ulysses_exchanges_as_the_compiled_step_sends_them(exchange, mesh, kv_heads, heads):
    """Ulysses's all-to-alls (and the hybrid's ring across its groups): describe's line per layer and
    microbatch is the formula, the compiled step sends as much, and the step memory model, which counts
    the whole sequence's scores for a c-th of the heads, is within the toy models' 30% of the compiled peak."""
    import io

    from meshtron.describe import describe
    from meshtron.models.context_attention import exchange_bytes
    from meshtron.units import format_bytes

    out = io.StringIO()
    describe(load_config(None, [*MODEL, *mesh, "parallel.pipe=1", f"parallel.context_attention={exchange}",
                                "model.remat=none"]), out)
    text = out.getvalue()
    cfg = load_config(None, [*MODEL, *mesh, "parallel.pipe=1"])
    ranks = cfg.mesh.context
    tokens = 8 // cfg.mesh.data // 2 * SEQ // ranks
    forward, backward = exchange_bytes(exchange, ranks, tokens, kv_heads=kv_heads, head_dim=32 // cfg.model.heads,
                                       heads=heads, ulysses_degree=2 if exchange == "hybrid" else None)
    per_layer = forward + backward
    said = {"ulysses": f"rank r holds the r-th of {ranks} contiguous slices of every sequence), an all-to-all turns "
                       f"queries, keys and values into the whole sequence for 1/{ranks} of the heads",
            "hybrid": "whose key/value blocks pass around a ring of the 2 groups (ranks 2 apart)"}[exchange]
    assert said in text, text
    assert f"{format_bytes(per_layer)} per device, layer and microbatch" in text, text
    assert (f"{exchange} exchange over context: {format_bytes(per_layer)} per layer and microbatch in the compiled "
            f"step, {format_bytes(per_layer)} by the formula (+0.0%)") in text, text
    error = float(re.search(r"\(([-+][\d.]+)% against the compiled peak\)", text)[1])
    assert abs(error) <= 30, f"modelled peak {error:+.1f}% off the compiled one"


def test_the_planner_s_exchange_formula_is_the_models():
    """:func:`meshtron.plan.model.exchange_wire_bytes` (pure Python, for the planner) equals
    :func:`meshtron.models.context_attention.exchange_bytes` for every exchange, GQA repetition included."""
    from meshtron.models.context_attention import exchange_bytes
    from meshtron.plan.model import exchange_wire_bytes

    for exchange, ranks, u in [("gathered", 8, None), ("ring", 8, None), ("ulysses", 4, None), ("ulysses", 8, None),
                               ("hybrid", 8, 2), ("hybrid", 16, 4), ("hybrid", 32, 8)]:
        for kv_heads in (1, 2, 6, 8, 32):
            args = (exchange, ranks, 4096, kv_heads, 128, 2)
            assert exchange_wire_bytes(*args, heads=32, ulysses_degree=u or 1) == pytest.approx(
                exchange_bytes(*args, heads=32, ulysses_degree=u)), (exchange, ranks, u, kv_heads)


def test_describe_plans_a_context_run_too_large_for_the_machine_on_all_its_devices():
    """Planning mode (more devices than the machine has) counts the context ranks: the devices the mesh
    needs, and the plan's layout, which then prices each GPU's share of the sequence."""
    import io

    from meshtron.describe import describe

    out = io.StringIO()
    describe(load_config("paper/gpt_1_7b", ["parallel.data=4", "parallel.pipe=2", "parallel.tensor=2", "parallel.context=4",
                                             "model.seq_len=32768", "train.batch_size=64"]), out)
    text = out.getvalue()
    assert "the mesh needs 64 devices" in text, text
    whole = io.StringIO()
    describe(load_config("paper/gpt_1_7b", ["parallel.data=4", "parallel.pipe=2", "parallel.tensor=2", "parallel.context=1",
                                             "model.seq_len=32768", "train.batch_size=64"]), whole)
    activations = [re.search(r"activations ([\d.]+)", t)[1] for t in (text, whole.getvalue())]
    assert float(activations[0]) < float(activations[1]) / 2, activations  # each GPU holds s/4 of a sequence


# ---- the planner -----------------------------------------------------------------------------------


def test_the_planner_splits_work_activations_and_tensor_traffic_over_context_ranks():
    from meshtron.models.context_attention import exchange_bytes
    from meshtron.plan.model import Layout as PlanLayout
    from meshtron.plan.model import ModelShape, activation_bytes, context_wire_bytes
    from meshtron.plan.timing import layer_gemms

    model = ModelShape(layers=24, hidden=2304, heads=24, seq_len=32768, vocab_size=51200)
    whole = PlanLayout(2, 2, 4, 1, 64, recompute="selective")
    split = PlanLayout(2, 2, 4, 1, 64, recompute="selective", context=4)
    assert split.gpus == 4 * whole.gpus and split.replicas == 16
    # every rank does a quarter of the work and holds a quarter of the activations
    assert sum(f for f, _ in layer_gemms(model, split)) == pytest.approx(sum(f for f, _ in layer_gemms(model, whole)) / 4)
    assert activation_bytes(model, split) == pytest.approx(activation_bytes(model, whole) / 4)
    # the exchange is the all-gather's formula (keys and values of h/t width, 16 bits; selective reruns the core)
    forward, backward = exchange_bytes("gathered", 4, tokens=32768 // 4, kv_heads=24 // 2, head_dim=2304 // 24,
                                       itemsize=2)
    assert context_wire_bytes(model, split) == pytest.approx(2 * forward + backward)
    assert context_wire_bytes(model, whole) == 0
    assert PlanLayout(1, 1, 1, 1, 8, context=3).problem(model) == "context=3 needs seq_len (32768) divisible by 2 x context"


def test_the_planner_s_activations_count_the_scores_each_exchange_holds_as_the_step_memory_model_does():
    """Without recomputation the scores are kept: the gathered exchange and Ulysses hold a c-th of a whole
    sequence's (s/c queries against every key, every query for a c-th of the heads), the ring one s/c x s/c
    block, the hybrid a group's block for a u-th of the heads -- the step memory model's score elements."""
    from meshtron.plan.model import Layout as PlanLayout
    from meshtron.plan.model import (
        ModelShape,
        activation_bytes,
        in_flight_chunks,
        layer_score_bytes,
        score_share,
    )
    from meshtron.plan.step_memory import StepRun, StepShape, score_elements

    model = ModelShape(layers=24, hidden=2304, heads=24, seq_len=32768, vocab_size=51200)
    whole = PlanLayout(2, 2, 4, 1, 64, recompute="none")
    gathered = replace(whole, context=8)
    assert activation_bytes(model, gathered) == pytest.approx(activation_bytes(model, whole) / 8)
    kept_layers = in_flight_chunks(2, gathered.microbatches, 1) * 24 // 2
    scores = layer_score_bytes(model, whole, "none")  # one layer's, of whole sequences
    shape = StepShape("gpt", 24, 2304, 24, 24, 4 * 2304, 51200, 32768, 32768)
    for exchange, u, share in [("ulysses", 8, 1 / 8), ("ring", 1, 1 / 64), ("hybrid", 2, 2 / 64), ("hybrid", 4, 4 / 64)]:
        layout = replace(gathered, context_attention=exchange, ulysses_degree=u if exchange == "hybrid" else 1)
        assert score_share(layout) == pytest.approx(share)
        run = StepRun(1, 2, 2, 1, context=8, context_attention=exchange, ulysses_degree=layout.ulysses_degree)
        assert share == pytest.approx(score_elements(shape, run) / (24 / 2 * 32768**2)), exchange
        assert activation_bytes(model, layout) - activation_bytes(model, gathered) == pytest.approx(
            kept_layers * scores * (share - 1 / 8)), exchange
    # selective recomputation keeps no scores: every exchange holds a c-th of the layer's activations
    selective = [activation_bytes(model, replace(gathered, recompute="selective", context_attention=e, ulysses_degree=u))
                 for e, u in [("gathered", 1), ("ring", 1), ("ulysses", 1), ("hybrid", 2)]]
    assert selective == pytest.approx([selective[0]] * 4)


def test_plan_takes_a_context_size():
    import contextlib
    import io

    from meshtron.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--config", "paper/gpt_1_7b", "--gpus", "64", "--context", "4", "--batch", "64",
                     "model.seq_len=32768", "--top", "2"]) == 0
    assert "every sequence split over 4 context ranks (keys and values all-gathered)" in out.getvalue()


def test_rules_that_keep_the_sequence_whole_cannot_split_it(monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    import parallel_lm

    md = ModelDef.create(lambda r: parallel_lm.ParallelLM(64, 32, 4, 64, 4, SEQ, rngs=r),
                         rules=extend_rules(MEGATRON_RULES, {**parallel_lm.RULES, "seq": None}))
    with pytest.raises(ConfigError, match=r"^model.rules.seq: parallel.context=2 splits every sequence over 'context', "
                                          r"but the rules place the logical axis seq on None"):
        check_parity(md, [Layout(1, 1, 1, context=2)], seq_len=SEQ)


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["gathered", "ring", "ulysses"])
def test_sequence_parallelism_inside_a_context_rank_keeps_parity(exchange):
    # the residual stream split over context x tensor: sequence parallelism's rule on top of the split
    md = model_def_from_config(ModelConfig(family="llama", vocab_size=64, hidden=32, heads=4, kv_heads=2, layers=4,
                                           mlp_dim=64, seq_len=SEQ, sequence_parallel=True), 2)
    [report] = check_parity(md, [Layout(2, 1, 2, context=2, context_attention=exchange)], seq_len=SEQ)
    assert report.ok
