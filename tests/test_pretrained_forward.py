"""``Pretrained.logits`` and ``Pretrained.loss``: an imported Llama's logits equal Hugging Face's on one
device and on (2,2,2) for a batch the data axis does not divide, shorter than the window; each shape
compiles once; the losses equal a NumPy cross-entropy of those logits, masked or not; the docs'
example runs; a model's own ``loss`` is the one used; bad inputs are one line naming the argument.

The reference model is built from a config with ``transformers``' classes (nothing is downloaded) and
given large random weights, as in ``test_huggingface.py``; those tests are slow (torch) and skip
without it. The rest use a user's model (``tests/models/parallel_lm.py``) and need no torch.
"""

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_huggingface import scramble

from meshtron.config import Config, MeshConfig
from meshtron.huggingface import import_hf
from meshtron.mesh import build_mesh
from meshtron.models.contract import vocab_parallel_cross_entropy
from meshtron.pretrained import Pretrained, load_pretrained
from meshtron.sharding import MEGATRON_RULES, extend_rules
from meshtron.train.state import ModelDef

sys.path.insert(0, str(Path(__file__).parent / "models"))
import parallel_lm

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 300  # meshtron pads it to 384 (tensor 1) and 512 (tensor 2): the padding is cut off
POSITIONS = 32
LLAMA = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
         "max_position_embeddings": POSITIONS, "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0}
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (3, 12))  # 3 rows (data=2 does not divide), 12 < 32
TOLERANCE = 1e-5  # relative to the largest |logit|, which is of order 10
MEASURED: dict[str, str] = {}  # max|logit difference| per mesh, printed at the end (pytest -s)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """``(checkpoint directory, Hugging Face logits of TOKENS)`` of a tiny scrambled Llama."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("forward")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    scramble(torch, model)
    model.eval().save_pretrained(root / "hf")
    with torch.no_grad():
        reference = model(torch.tensor(TOKENS)).logits.float().numpy()
    yield import_hf(root / "hf", root / "meshtron"), reference
    if MEASURED:
        print("\nmax|logit delta|: " + ", ".join(f"{k} {v}" for k, v in sorted(MEASURED.items())))


def reference_losses(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Next-token cross-entropy [b, s - 1] of ``logits`` [b, s - 1, V] (float64 log-softmax, gathered)."""
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    log_softmax = x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))
    return -np.take_along_axis(log_softmax, tokens[:, 1:, None], axis=-1)[..., 0]


def check_forward(pretrained: Pretrained, reference: np.ndarray, name: str) -> None:
    logits = pretrained.logits(TOKENS)
    assert logits.shape == (3, 12, VOCAB) and logits.dtype == jnp.float32
    scale = float(np.max(np.abs(reference)))
    worst = float(np.max(np.abs(np.asarray(logits) - reference)))
    MEASURED[name] = f"{worst:.2e} (max|logit| {scale:.1f})"
    assert scale > 1.0 and worst <= TOLERANCE * scale, f"{name}: max|delta| {worst:.3g}, max|logit| {scale:.3g}"

    traces = pretrained._forward.traces
    np.testing.assert_array_equal(np.asarray(pretrained.logits(TOKENS.astype(np.int64))), np.asarray(logits))
    assert pretrained._forward.traces == traces  # the same shape runs the kept program

    # token t + 1 predicted from positions <= t: the logits of all but the last token
    expected = reference_losses(np.asarray(pretrained.logits(TOKENS[:, :-1])), TOKENS)
    losses = pretrained.loss(TOKENS)
    assert losses.shape == (3, 11) and losses.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(losses), expected, rtol=1e-5, atol=1e-5)
    mask = np.random.default_rng(1).random((3, 11)) < 0.5
    np.testing.assert_allclose(np.asarray(pretrained.loss(TOKENS, mask)), np.where(mask, expected, 0.0),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_logits_and_losses_on_one_device(imported):
    directory, reference = imported
    check_forward(load_pretrained(directory, MeshConfig(1, 1, 1)), reference, "1x1x1")


@pytest.mark.slow
def test_logits_and_losses_on_data_pipe_tensor(imported):
    directory, reference = imported
    pretrained = load_pretrained(directory, MeshConfig(2, 2, 2))
    assert dict(pretrained.mesh.shape) == {"data": 2, "pipe": 2, "context": 1, "tensor": 2}
    check_forward(pretrained, reference, "2x2x2")


@pytest.mark.slow
def test_the_docs_example_scores_a_text(imported, tmp_path, monkeypatch, capsys):
    from test_readme import run_example

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "llama1b").symlink_to(imported[0])
    monkeypatch.chdir(tmp_path)
    namespace = run_example("forward")
    tokens, logits, losses = namespace["tokens"], namespace["logits"], namespace["losses"]
    assert logits.shape == (1, tokens.shape[1], VOCAB) and losses.shape == (1, tokens.shape[1] - 1)
    np.testing.assert_allclose(np.asarray(losses), reference_losses(np.asarray(logits)[:, :-1], tokens),
                               rtol=1e-5, atol=1e-5)
    assert capsys.readouterr().out.startswith("perplexity ")


class OwnLoss(parallel_lm.ParallelLM):
    """A user's model with a loss of its own (cross-entropy plus a z-loss)."""

    def loss(self, logits, targets):
        z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_size) + 0.5 * z**2


@pytest.fixture(scope="module")
def own():
    """A user's model with its own loss, 16 positions, a vocabulary of 64, on data 2 x tensor 2."""
    model_def = ModelDef.create(lambda r: OwnLoss(64, 32, 4, 64, 2, 16, rngs=r),
                                rules=extend_rules(MEGATRON_RULES, parallel_lm.RULES))
    mesh = build_mesh(MeshConfig(2, 1, 2), jax.devices()[:4])
    return Pretrained(model_def, model_def.init(mesh, 0), mesh, 0, Config())


@pytest.mark.both_stacks
def test_a_models_own_loss_is_the_one_used(own):
    """3 rows on data 2 x tensor 2: the model's ``loss`` applied to its logits."""
    tokens = np.random.default_rng(2).integers(0, 64, (3, 9))
    logits = np.asarray(own.logits(tokens[:, :-1])).astype(np.float64)
    assert logits.shape == (3, 8, 64)
    z = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(np.asarray(own.loss(tokens)), reference_losses(logits, tokens) + 0.5 * z**2,
                               rtol=1e-5, atol=1e-5)


ROWS = np.random.default_rng(3).integers(0, 64, (3, 12))


@pytest.mark.parametrize("call, message", [
    (lambda p: p.logits(ROWS.astype(np.float32)), r"^tokens: dtype float32 is not an integer type"),
    (lambda p: p.logits(ROWS[0]), r"^tokens: shape \(12,\) is not \[batch, seq\].*tokens\[None\]"),
    (lambda p: p.logits(ROWS[None]), r"^tokens: shape \(1, 3, 12\) is not \[batch, seq\]"),
    (lambda p: p.logits(ROWS + 64), r"^tokens: id \d+ is outside the vocabulary \[0, 64\)"),
    (lambda p: p.loss(-ROWS - 1), r"^tokens: id -\d+ is outside the vocabulary \[0, 64\)"),
    (lambda p: p.logits(np.zeros((1, 17), np.int32)), r"^tokens: 17 tokens per row exceed the model's limit of 16"),
    (lambda p: p.loss(np.zeros((1, 18), np.int32)), r"^tokens: 18 tokens per row exceed the model's limit of 17"),
    (lambda p: p.loss(ROWS[:, :1]), r"^tokens: shape \(3, 1\) needs at least one row of at least 2 tokens"),
    (lambda p: p.loss(ROWS, np.ones((3, 12), bool)), r"^loss_mask: shape \(3, 12\) is not the targets' \(3, 11\)"),
    (lambda p: p.loss(ROWS, np.full((3, 11), 0.5)), r"^loss_mask: holds values other than 0 and 1"),
])
def test_bad_inputs_are_one_line(own, call, message):
    with pytest.raises(ValueError, match=message) as caught:
        call(own)
    assert "\n" not in str(caught.value)
