"""Sampling: greedy equals a step-by-step forward pass, any mesh gives the same text, the window
slides past ``seq_len``, sampling is seeded and never emits padded ids, bad arguments are named."""

import jax
import numpy as np
import pytest

from meshtron.config import MeshConfig, ModelConfig
from meshtron.generate import Sampler, SampleResult, decode_tokens, encode_prompt, sample
from meshtron.mesh import build_mesh
from meshtron.train.state import ModelDef, dims_from_config

MODEL = ModelConfig(vocab_size=256, hidden=32, heads=4, layers=2, mlp_dim=64, seq_len=32)
SEQ = MODEL.seq_len
VOCAB = MODEL.vocab_size
OTHER_MESHES = [(8, 1, 1), (2, 2, 2), (1, 2, 4)]


def mesh_of(shape):
    return build_mesh(MeshConfig(*shape), jax.devices()[: int(np.prod(shape))])


def distinctive(params, seed: int = 0):
    """Init values plus noise, and huge padded embedding rows.

    A freshly initialised GPT with tied embeddings greedily repeats one byte forever, which would
    make "same tokens" a weak check; noise on the weights (LayerNorms left alone) gives varied
    text. The padded rows of the tied embedding (ids >= 256) are made large so that their logits
    dominate: any sampling path that forgot to mask them would emit them.
    """
    rng = np.random.default_rng(seed)

    def perturb(path, a):
        if "ln" in jax.tree_util.keystr(path):
            return a
        return (a + rng.normal(0.0, 0.3, a.shape)).astype(a.dtype)

    host = jax.tree_util.tree_map_with_path(perturb, jax.device_get(params))
    host["wte"][VOCAB:] = rng.normal(0.0, 5.0, host["wte"][VOCAB:].shape).astype(host["wte"].dtype)
    return host


@pytest.fixture(scope="module")
def setup():
    # Vocabulary padded for tensor=4 (512 ids, 256 of them padding) so every mesh shares one shape.
    md = ModelDef.create(dims_from_config(MODEL, tensor=4))
    assert md.dims.vocab_padded > md.dims.vocab_size
    mesh = mesh_of((1, 1, 1))
    host = distinctive(md.init(mesh, seed=0))
    params = jax.device_put(host, md.shardings(mesh))
    # chunk=8: most requests below span several calls of the compiled program.
    return md, mesh, host, params, Sampler(md, mesh, chunk=8)


def full_model_logits(md, params):
    """Logits of the last position, from the whole model run on exactly the given context."""
    forward = jax.jit(lambda p, t: md.bind(p)(t))
    return lambda context: np.asarray(forward(params, np.asarray(context, np.int32)[None]))[0, -1]


def reference_greedy(md, params, prompt_ids, n):
    """Step by step: the model on the growing text (its last seq_len tokens), argmax over real ids."""
    logits_of = full_model_logits(md, params)
    tokens, padded_would_win = list(prompt_ids), False
    for _ in range(n):
        logits = logits_of(tokens[-SEQ:])
        padded_would_win |= int(np.argmax(logits)) >= VOCAB
        tokens.append(int(np.argmax(logits[:VOCAB])))
    return tokens[len(prompt_ids):], padded_would_win


def test_greedy_equals_step_by_step_full_model(setup):
    md, _, _, params, sampler = setup
    # 28 prompt bytes + 9 new tokens: the context grows to seq_len (32), then slides for 4 steps.
    prompt = "The quick brown fox jumps ov"
    assert len(prompt) == 28
    expected, padded_would_win = reference_greedy(md, params, list(prompt.encode()), 9)
    assert padded_would_win  # the padded rows matter: unmasked argmax would pick one
    result = sampler.sample(params, prompt, max_new_tokens=9)
    assert list(result.new_tokens) == expected
    assert len(set(expected)) > 2  # varied text, not one repeated byte
    assert result.prompt_tokens == tuple(prompt.encode())
    assert result.text == decode_tokens(result.tokens)


@pytest.mark.parametrize("mesh_shape", OTHER_MESHES)
def test_every_mesh_gives_the_same_tokens(setup, mesh_shape):
    md, _, host, params, sampler = setup
    expected_greedy = sampler.sample(params, "Hello, mesh", max_new_tokens=20)
    expected_sampled = sampler.sample(params, "Hello, mesh", max_new_tokens=20, temperature=1.0, top_k=20, seed=3)
    other = mesh_of(mesh_shape)
    moved = jax.device_put(host, md.shardings(other))
    other_sampler = Sampler(md, other, chunk=8)
    assert other_sampler.sample(moved, "Hello, mesh", max_new_tokens=20) == expected_greedy
    sampled = other_sampler.sample(moved, "Hello, mesh", max_new_tokens=20, temperature=1.0, top_k=20, seed=3)
    assert sampled == expected_sampled


def test_host_parameters_are_placed_on_the_mesh(setup):
    md, _, host, params, sampler = setup
    # The one-call API with plain numpy parameters (as a restored checkpoint might give them).
    other = mesh_of((2, 1, 2))
    result = sample(md, host, other, "Hi", max_new_tokens=5)
    assert result == sampler.sample(params, "Hi", max_new_tokens=5)


def test_sampling_is_seeded_and_never_emits_padded_ids(setup):
    _, _, _, params, sampler = setup

    def hot(seed):
        return sampler.sample(params, "abc", max_new_tokens=40, temperature=3.0, seed=seed).new_tokens

    first, again, other = hot(0), hot(0), hot(1)
    assert first == again  # same seed, same text
    assert first != other  # another seed, other text
    for tokens in (first, other):
        assert all(0 <= t < VOCAB for t in tokens)  # the huge padded logits never win
        assert len(set(tokens)) > 10  # a hot temperature really samples
    greedy = sampler.sample(params, "abc", max_new_tokens=20)
    for seed in range(3):
        top1 = sampler.sample(params, "abc", max_new_tokens=20, temperature=1.5, top_k=1, seed=seed)
        assert top1 == greedy


def test_chunk_size_does_not_change_the_tokens(setup):
    md, mesh, _, params, sampler = setup
    kwargs = {"max_new_tokens": 19, "temperature": 1.0, "seed": 7}
    assert Sampler(md, mesh).sample(params, "chunks", **kwargs) == sampler.sample(params, "chunks", **kwargs)


def test_top_k_only_draws_from_the_k_most_likely(setup):
    md, _, _, params, sampler = setup
    prompt = list(b"top-k")
    logits = full_model_logits(md, params)(prompt)[:VOCAB]
    top3 = set(np.argsort(logits)[-3:].tolist())
    drawn = {
        sampler.sample(params, prompt, max_new_tokens=1, temperature=10.0, top_k=3, seed=s).new_tokens[0]
        for s in range(30)
    }
    assert drawn <= top3 and len(drawn) > 1


def test_window_slides_past_seq_len(setup):
    _, _, _, params, sampler = setup
    result = sampler.sample(params, "Hello", max_new_tokens=3 * SEQ)
    tokens = result.tokens
    assert len(result.new_tokens) == 3 * SEQ and len(set(result.new_tokens)) > 2
    # Past seq_len the next token depends on the last seq_len tokens only: restarting from them,
    # as a prompt of exactly seq_len tokens or inside a longer prompt, continues the same way.
    for cut in (40, 70):
        for prompt in (tokens[cut - SEQ:cut], tokens[:cut]):
            again = sampler.sample(params, list(prompt), max_new_tokens=len(tokens) - cut)
            assert again.new_tokens == tokens[cut:]


@pytest.mark.parametrize(
    ("prompt", "kwargs", "argument"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1, 256], {}, "prompt"),
        ([1, -1], {}, "prompt"),
        ([1.5], {}, "prompt"),
        ("ok", {"max_new_tokens": 0}, "max_new_tokens"),
        ("ok", {"temperature": -0.1}, "temperature"),
        ("ok", {"temperature": float("nan")}, "temperature"),
        ("ok", {"top_k": 0}, "top_k"),
        ("ok", {"top_k": VOCAB + 1}, "top_k"),
    ],
)
def test_bad_arguments_name_the_argument(setup, prompt, kwargs, argument):
    md, mesh, _, params, _ = setup
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=f"^{argument}:"):
        sample(md, params, mesh, prompt, **kwargs)


def test_decoding_never_fails():
    assert decode_tokens([0xFF, 0xFE, 104, 105]) == "\ufffd\ufffdhi"
    assert decode_tokens([104, 300, 105]) == "h\ufffdi"  # an id beyond the byte range
    assert encode_prompt("é") == [0xC3, 0xA9]
    # A character split between prompt and continuation survives in the joined text.
    split = SampleResult(prompt_tokens=(0xC3,), new_tokens=(0xA9, 0x21))
    assert split.text == "é!" and split.continuation == "\ufffd!"
    whole = SampleResult(prompt_tokens=tuple(b"ab"), new_tokens=tuple("ç".encode()))
    assert whole.text == "abç" and whole.continuation == "ç"
