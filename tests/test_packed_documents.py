"""Packed documents: a document's logits inside a packed window equal its logits run alone; the loss
counts each document's own next tokens, as its mask says; the loss and every gradient of packed
windows equal one device's on data x pipeline x context x tensor layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtron.models import documents
from meshtron.models.contract import Context, logits_of, next_token_pairs, token_losses
from meshtron.testing import Layout, check_parity, packed_windows
from meshtron.train.state import ModelDef

SEQ = 32
LENGTHS = (9, 5, 12, 7)  # three documents and padding fill a window of SEQ + 1 tokens


def family(name: str, tensor: int = 1) -> ModelDef:
    from families import small

    return small(name, SEQ, tensor, hidden=64, heads=8)  # heads split over 8 tensor ranks


def window(rng) -> np.ndarray:
    """One row ``[1, SEQ + 1, 3]``: documents of LENGTHS[:-1] tokens, then padding; all counted."""
    tokens = rng.integers(0, 64, size=SEQ + 1)
    segments = np.concatenate([np.full(n, i + 1 if i < len(LENGTHS) - 1 else 0) for i, n in enumerate(LENGTHS)])
    return np.stack([tokens, segments, np.ones(SEQ + 1, int)], axis=-1)[None].astype(np.int32)


def test_features_restart_positions_and_count_each_document_s_own_next_tokens():
    win = jnp.asarray([[[10, 1, 1], [11, 1, 1], [12, 1, 1], [20, 2, 1], [21, 2, 0], [22, 2, 1], [0, 0, 0]]])
    seen = documents.view(documents.document_features(win))
    assert seen.inputs.tolist() == [[10, 11, 12, 20, 21, 22]]
    assert seen.targets.tolist() == [[11, 12, 20, 21, 22, 0]]
    assert seen.positions.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert seen.segments.tolist() == [[1, 1, 1, 2, 2, 2]]
    # counted: 10->11, 11->12, 21->22 (12->20 crosses documents, target 21 is masked, 22->pad is padding),
    # each weighted 6/3 so that the mean over all six is the mean over the three
    assert np.asarray(seen.weights).tolist() == [[2.0, 2.0, 0.0, 0.0, 2.0, 0.0]]


# CI runs Llama and the user's model; make test GPT too
@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.extended), "llama", "user"])
def test_a_document_s_logits_in_a_packed_window_equal_its_logits_alone(name, monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    md = family(name)
    model = md.bind(_params(md))
    win = jnp.asarray(window(np.random.default_rng(0)))
    features = documents.document_features(win)
    inputs = next_token_pairs(features)[0]
    packed = np.asarray(jax.jit(lambda t, f: logits_of(model, t, ctx=Context.for_tokens(f)))(inputs, features))
    unmasked = np.asarray(jax.jit(lambda t: logits_of(model, t))(inputs))  # the window as one sequence
    start = 0
    for length in LENGTHS[:-1]:
        doc = win[:, start : start + length, 0]
        alone = np.asarray(jax.jit(lambda t: logits_of(model, t))(doc))
        # a document ends where the next begins; its last input (predicting the next's first) is not counted
        got = packed[:, start : start + length]
        np.testing.assert_allclose(got[..., : md.vocab_size], alone[..., : md.vocab_size], atol=1e-5, rtol=0)
        if start:  # without the documents' masks and positions a later document sees the earlier ones
            assert np.max(np.abs(unmasked[:, start : start + length] - alone)) > 1e-3
        start += length


def _params(md: ModelDef):
    from meshtron.config import MeshConfig
    from meshtron.mesh import build_mesh

    return jax.device_get(md.init(build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), 0))


def test_the_loss_is_the_mean_over_counted_targets_of_each_document_run_alone(monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    md = family("llama")
    params = _params(md)
    model = md.bind(params)
    rng = np.random.default_rng(1)
    win = packed_windows(rng, 4, SEQ, md.vocab_size)
    packed = float(jax.jit(md.loss)(params, documents.document_features(jnp.asarray(win))))
    # one program a document length (compiled, not run op by op): each document alone, through the contract
    alone = jax.jit(lambda doc: token_losses(model, logits_of(model, doc[None, :-1]), doc[None, 1:])[0])
    total, count = 0.0, 0
    for row in win:
        for segment in set(row[:, 1].tolist()) - {0}:
            where = np.flatnonzero(row[:, 1] == segment)
            doc = row[where]
            if len(doc) < 2:
                continue
            losses = np.asarray(alone(jnp.asarray(doc[:, 0])))
            counted = doc[1:, 2] == 1  # a target counts where its token's mask says so
            total += float(losses[counted].sum())
            count += int(counted.sum())
    assert packed == pytest.approx(total / count, rel=1e-5)


# zb-h1 at m = p = 2 (m = 2p compiled twice the ticks): B and W still split, stage 1's W deferred past
# its next B; zb-h1's steady state at m = 2p: tests/test_pipeline.py's every-schedule grid.
LAYOUTS = {
    "1x1x8": Layout(1, 1, 8),
    "2x2x2-interleaved": Layout(2, 2, 2, "interleaved", 2),
    "1x2x4-zbh1": Layout(1, 2, 4, "zb-h1", microbatches=2),
    "1x2x4-zbh1-kept": Layout(1, 2, 4, "zb-h1", microbatches=2, recompute=False),
    "2x1x2-context2": Layout(2, 1, 2, context=2),
    "1x1x1-context8-ring": Layout(1, 1, 1, context=8, context_attention="ring"),
    "1x2x1-context4-zbh1-ring": Layout(1, 2, 1, "zb-h1", microbatches=2, context=4, context_attention="ring"),
    "2x1x2-context2-ulysses": Layout(2, 1, 2, context=2, context_attention="ulysses"),
    "1x1x1-context4-hybrid-u2": Layout(1, 1, 1, context=4, context_attention="hybrid", ulysses_degree=2),
}
FAST = {("llama", "2x2x2-interleaved"), ("gpt", "1x2x4-zbh1"), ("user", "1x1x8"), ("llama", "1x1x1-context8-ring"),
        ("llama", "2x1x2-context2-ulysses")}
# CI runs every layout once, on one family each (every family on several); make test runs the other families.
CI = FAST | {("user", "1x2x4-zbh1-kept"), ("gpt", "2x1x2-context2"), ("user", "1x2x1-context4-zbh1-ring"),
             ("user", "1x1x1-context4-hybrid-u2")}


def _params_for_layouts():
    for name in ("gpt", "llama", "user"):
        for key, layout in LAYOUTS.items():
            marks = [] if (name, key) in FAST else [pytest.mark.slow]
            if (name, key) not in CI:
                marks.append(pytest.mark.extended)
            if (name, key) in {("llama", "2x2x2-interleaved"), ("llama", "1x1x1-context8-ring")}:
                marks.append(pytest.mark.both_stacks)
            yield pytest.param(name, layout, id=f"{name}-{key}", marks=marks)


@pytest.mark.parametrize("name, layout", list(_params_for_layouts()))
def test_packed_loss_and_gradients_equal_one_device(name, layout, monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    [report] = check_parity(family(name, layout.tensor), [layout], seq_len=SEQ, documents=True)
    assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6)
