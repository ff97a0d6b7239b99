"""Sampling: greedy equals a step-by-step forward pass, any mesh gives the same text, the window
slides past ``seq_len``, sampling is seeded and never emits padded ids, bad arguments are named;
the KV-cache path gives the same tokens as the full-window path for both families on tensor-
parallel meshes, compiles one program, and is chosen (or refused) according to the mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtron.config import MeshConfig, MlaConfig, ModelConfig, MoEConfig
from meshtron.generate import (
    Sampler,
    SampleResult,
    decode_tokens,
    default_stops,
    encode_prompt,
    first_stop,
    sample,
)
from meshtron.mesh import build_mesh
from meshtron.sharding import axis_rules
from meshtron.train.state import model_def_from_config

pytestmark = pytest.mark.both_stacks

MODEL = ModelConfig(vocab_size=256, hidden=32, heads=4, layers=2, mlp_dim=64, seq_len=32)
SEQ = MODEL.seq_len
VOCAB = MODEL.vocab_size
OTHER_MESHES = [(8, 1, 1), (2, 2, 2), (1, 2, 4)]
# Both families at the same tiny size. Llama: grouped-query attention (2 query heads per key/value
# head) with 4 key/value heads, so that tensor=4 splits its cache as it splits GPT's.
FAMILIES = {
    "gpt": MODEL,
    "llama": ModelConfig(family="llama", vocab_size=256, hidden=64, heads=8, kv_heads=4, layers=2, mlp_dim=64,
                         seq_len=SEQ),
    # A Mixtral: the Llama block with 8 experts, top-2 (split over data by the default rules).
    "mixtral": ModelConfig(family="llama", vocab_size=256, hidden=64, heads=8, kv_heads=4, layers=2, mlp_dim=64,
                           seq_len=SEQ, moe=MoEConfig(experts=8, top_k=2, mlp_dim=32)),
    # DeepSeek: latent attention (its cache holds the latents), a dense block, then 8 experts top-2 and a
    # shared one; YaRN rotary positions.
    "deepseek": ModelConfig(family="deepseek", vocab_size=256, hidden=64, heads=8, layers=2, mlp_dim=64, seq_len=SEQ,
                            moe=MoEConfig(experts=8, top_k=2, mlp_dim=32, shared_experts=1), first_k_dense_replace=1,
                            mla=MlaConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                          v_head_dim=8),
                            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                          "mscale": 1.0, "mscale_all_dim": 1.0}),
}
CACHE_MESHES = [(1, 1, 1), (1, 1, 4), (2, 1, 4)]


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


def distinctive_any(md, params, seed: int = 0):
    """:func:`distinctive` for any family: noise on every weight but the norms, huge padded rows in
    every vocabulary-first parameter (the output head among them)."""
    rng = np.random.default_rng(seed)

    def perturb(path, a):
        name = jax.tree_util.keystr(path)
        if "ln" in name or "norm" in name:
            return a
        a = (a + rng.normal(0.0, 0.3, a.shape)).astype(a.dtype)
        if any(name.endswith(f"['{v}']") for v in md.vocab_parameters()):
            a[VOCAB:] = rng.normal(0.0, 5.0, a[VOCAB:].shape).astype(a.dtype)
        return a

    return jax.tree_util.tree_map_with_path(perturb, jax.device_get(params))


@pytest.fixture(scope="module")
def family_models():
    """Model definition and distinctive host parameters of each family (vocabulary padded for tensor=4)."""
    models = {}
    for family, cfg in FAMILIES.items():
        md = model_def_from_config(cfg, tensor=4)
        assert md.can_cache
        models[family] = (md, distinctive_any(md, md.init(mesh_of((1, 1, 1)), seed=1)))
    return models


@pytest.fixture(scope="module")
def setup():
    # Vocabulary padded for tensor=4 (512 ids, 256 of them padding) so every mesh shares one shape.
    md = model_def_from_config(MODEL, tensor=4)
    assert md.vocab_padded > md.vocab_size
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


# Data alone (8,1,1) runs on the first stack; the second moves the parameters onto the meshes with
# a pipeline and tensor split, data in (2,2,2).
@pytest.mark.parametrize("mesh_shape", [pytest.param(m, marks=pytest.mark.first_stack_only) if m == (8, 1, 1) else m
                                        for m in OTHER_MESHES])
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
        ("ok", {"top_p": 0.0}, "top_p"),
        ("ok", {"top_p": 1.5}, "top_p"),
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


# Every family and every mesh once on the second stack: GPT on one device, Llama's cache split over tensor,
# Mixtral's experts split over data as well; the other pairs run on the first.
_CACHE_ON_BOTH = {("gpt", CACHE_MESHES[0]), ("llama", CACHE_MESHES[1]), ("mixtral", CACHE_MESHES[2])}
# CI runs those and DeepSeek on data x tensor; make test runs every other pair.
_CACHE_IN_CI = _CACHE_ON_BOTH | {("deepseek", CACHE_MESHES[2])}


def _cache_marks(family: str, mesh: tuple[int, int, int]) -> list:
    marks = [] if (family, mesh) in _CACHE_ON_BOTH else [pytest.mark.first_stack_only]
    return marks + ([] if (family, mesh) in _CACHE_IN_CI else [pytest.mark.extended])


@pytest.mark.parametrize(("family", "mesh_shape"), [
    pytest.param(family, mesh, id=f"{family}-mesh_shape{i}", marks=_cache_marks(family, mesh))
    for family in FAMILIES for i, mesh in enumerate(CACHE_MESHES)])
def test_kv_cache_gives_the_full_window_tokens(family_models, family, mesh_shape):
    md, host = family_models[family]
    mesh = mesh_of(mesh_shape)
    params = jax.device_put(host, md.shardings(mesh))
    cached = Sampler(md, mesh, chunk=8, context=SEQ)
    full = Sampler(md, mesh, chunk=8, context=SEQ, use_cache=False)
    assert cached.use_cache and not full.use_cache
    long_prompt = list(range(40, 40 + SEQ + 9))  # longer than the context: starts full, slides every step
    requests = [
        ("Hello, cache", {"max_new_tokens": 3 * SEQ}),  # grows to the context, then slides for 2 windows
        ("Hello, cache", {"max_new_tokens": 40, "temperature": 1.0, "top_k": 20, "seed": 3}),
        ("Hello, cache", {"max_new_tokens": 30, "temperature": 0.7, "seed": 11}),
        (long_prompt, {"max_new_tokens": 12}),
        (long_prompt, {"max_new_tokens": 12, "temperature": 1.0, "top_k": 5, "seed": 5}),
    ]
    for prompt, kwargs in requests:
        expected = full.sample(params, prompt, **kwargs)
        assert cached.sample(params, prompt, **kwargs) == expected, (prompt, kwargs)
        assert all(0 <= t < VOCAB for t in expected.new_tokens)
    greedy = full.sample(params, "Hello, cache", max_new_tokens=3 * SEQ).new_tokens
    assert len(set(greedy[SEQ:])) > 2  # varied text after the slide, not one repeated byte


def cache_spec(sampler, params):
    """The layout of the sampler's empty cache (keys) on its mesh."""
    with jax.set_mesh(sampler.mesh), axis_rules(sampler._rules):
        return sampler._empty_cache(params).k.sharding.spec


@pytest.mark.parametrize(("kv_heads", "split"), [(4, True), (2, False)])
def test_cache_follows_the_tensor_split_of_key_value_heads(kv_heads, split):
    cfg = dataclasses.replace(FAMILIES["llama"], kv_heads=kv_heads)
    md = model_def_from_config(cfg, tensor=4)
    mesh = mesh_of((2, 1, 4))
    spec = tuple(cache_spec(Sampler(md, mesh, context=SEQ), md.init(mesh, seed=0)))
    spec += (None,) * (5 - len(spec))  # [layers, batch, seq, kv_heads, head_dim]
    assert spec[:3] == (None, None, None)  # batch replicated over data: one sequence
    assert spec[3] == ("tensor" if split else None) and spec[4] is None


def test_decoding_compiles_once_whatever_the_request(setup):
    md, mesh, _, params, _ = setup
    sampler = Sampler(md, mesh, chunk=8)
    assert sampler.use_cache
    for prompt, kwargs in [
        ("a", {"max_new_tokens": 1}),
        ("a longer prompt", {"max_new_tokens": 9}),
        ("x" * (SEQ - 1), {"max_new_tokens": 3}),  # fills the context after one token
        (list(range(1, SEQ + 20)), {"max_new_tokens": 30, "temperature": 0.5, "top_k": 4, "seed": 2}),
        ("b", {"max_new_tokens": 2 * SEQ, "temperature": 2.0}),
    ]:
        sampler.sample(params, prompt, **kwargs)
    assert sampler._traces == 1
    assert sampler._decode._cache_size() == 1  # one compiled decoding program (prefill included)
    assert sampler._empty_cache._cache_size() == 1


def test_cache_is_used_when_the_model_and_mesh_allow_it(setup):
    md, mesh, _, _, _ = setup
    pipelined = mesh_of((2, 2, 2))
    assert Sampler(md, mesh).use_cache
    assert not Sampler(md, mesh, use_cache=False).use_cache
    # pipe > 1: the full window by default (same tokens, see test_every_mesh_gives_the_same_tokens),
    # an error naming the fix when the cache is asked for.
    assert not Sampler(md, pipelined).use_cache
    with pytest.raises(ValueError, match=r"^use_cache: .*pipe=1.*parallel\.pipe=1"):
        Sampler(md, pipelined, use_cache=True)
    # A model without init_cache re-runs the full window; insisting on the cache is an error.
    uncached = dataclasses.replace(md, can_cache=False)
    assert not Sampler(uncached, mesh).use_cache
    with pytest.raises(ValueError, match="^use_cache: .*init_cache"):
        Sampler(uncached, mesh, use_cache=True)


def test_generation_ends_at_a_stop_sequence_and_leaves_it_out(setup):
    _, _, _, params, sampler = setup
    full = sampler.sample(params, "Hello, mesh", max_new_tokens=20, stop=[])
    assert full.finish_reason == "length" and len(full.new_tokens) == 20
    ids = list(full.new_tokens)
    one, two = ids[9], ids[12:14]
    stopped = sampler.sample(params, "Hello, mesh", max_new_tokens=20, stop=[[one], two])
    end = min(ids.index(one), next(i for i in range(19) if ids[i : i + 2] == two))
    assert stopped.finish_reason == "stop" and list(stopped.new_tokens) == ids[:end]
    # the default: the chat template's end of an answer (bytes have no end-of-text id)
    assert default_stops(None) == (tuple(b"<|end|>"),)
    assert first_stop([5, 1, 2, 3], [(2, 3), (9,)]) == 2 and first_stop([5, 1], [(2, 3)]) is None
    with pytest.raises(ValueError, match=r"stop: a stop sequence is empty"):
        sampler.sample(params, "Hello", max_new_tokens=2, stop=[[]])


def test_a_tokenizers_end_of_text_id_ends_generation_by_default(tmp_path):
    from meshtron.data.tokenizers import train_bpe

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    tokenizer = train_bpe([text], 280, tmp_path / "tokenizer.json", min_frequency=1)
    assert default_stops(tokenizer) == ((tokenizer.eod,),)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 0.9), (0.5, 7, 1.0), (2.0, 20, 0.6), (0.7, 3, 0.3),
                                                      (1.3, 0, 0.05)])
def test_sampling_logits_are_hugging_faces_warped_logits(temperature, top_k, top_p):
    """temperature, then top-k, then top-p, as transformers' generate warps the logits before sampling."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from meshtron.generate import sampling_logits

    logits = np.random.default_rng(int(temperature * 10 + top_k)).normal(0, 2, (4, 50)).astype(np.float32)
    theirs = torch.from_numpy(logits)
    for warper in [TemperatureLogitsWarper(temperature), *([TopKLogitsWarper(top_k)] if top_k else []),
                   *([TopPLogitsWarper(top_p)] if top_p < 1 else [])]:
        theirs = warper(None, theirs)
    ours = np.asarray(sampling_logits(jnp.asarray(logits), jnp.float32(temperature), jnp.int32(top_k or 50),
                                      jnp.float32(top_p)))
    assert (np.isfinite(ours) == np.isfinite(theirs.numpy())).all()
    assert 1 <= np.isfinite(ours).sum(axis=-1).min() and np.isfinite(ours).sum() < ours.size  # something was cut
    kept = np.isfinite(ours)
    np.testing.assert_allclose(ours[kept], theirs.numpy()[kept], rtol=1e-6)


def test_sampled_tokens_come_from_the_kept_set_in_proportion():
    """Drawn tokens (choose_token, many keys) cover exactly the top-k / top-p set, with the renormalised
    probabilities of the warped logits."""
    from meshtron.generate import choose_token, sampling_logits

    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32)
    logits = jnp.asarray(np.log(probs))
    keys = jax.random.split(jax.random.key(3), 4000)
    for top_k, top_p, support in [(6, 0.6, {0, 1}), (6, 0.7, {0, 1, 2}), (2, 1.0, {0, 1}), (6, 1.0, set(range(6)))]:
        drawn = np.asarray(jax.vmap(lambda k, top_k=top_k, top_p=top_p: choose_token(
            logits, k, jnp.float32(1.0), jnp.int32(top_k), 6, jnp.float32(top_p)))(keys))
        assert set(drawn.tolist()) == support
        expected = np.asarray(jax.nn.softmax(sampling_logits(logits, jnp.float32(1.0), jnp.int32(top_k),
                                                             jnp.float32(top_p))))
        np.testing.assert_allclose(np.bincount(drawn, minlength=6) / len(drawn), expected, atol=0.03)
