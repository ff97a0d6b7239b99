"""Batched decoding (:mod:`meshtron.batch_decode`, what ``meshtron eval`` generates with): prompts of
different lengths decoded together give each prompt's one-sequence greedy tokens
(:class:`meshtron.generate.Sampler`), with the KV cache and with the full window, for a GPT (learned
positions), a Llama and DeepSeek (latent attention, a dense prefix block), on one device and on meshes
that split rows over ``data``, weights over ``tensor`` and layers over ``pipe``; padded vocabulary ids
(made to dominate the logits) are never chosen; one compile per decoder whatever the calls. Sampled rows
(temperature / top-k / top-p) give the one-sequence sampler's tokens for their seeds whatever the batch
they are in; temperature 0 and top-k 1 give the greedy tokens.
"""

import jax
import pytest
from test_generate import FAMILIES, VOCAB, distinctive_any, mesh_of

from meshtron.batch_decode import BatchDecoder
from meshtron.generate import Sampler
from meshtron.train.state import model_def_from_config

PROMPTS = [[72, 101, 108, 108, 111], [84, 104], [65, 32, 108, 111, 110, 103, 101, 114, 32, 111, 110, 101], [7],
           [50, 51, 52]]
NEW = 9
CONTEXT = 24  # the longest prompt (12) plus NEW fits


@pytest.mark.parametrize("family, shape, use_cache", [
    ("gpt", (1, 1, 1), None),
    pytest.param("gpt", (1, 1, 1), False, marks=pytest.mark.slow),
    pytest.param("gpt", (2, 2, 2), None, marks=pytest.mark.slow),  # pipe=2: the full window
    pytest.param("llama", (2, 1, 4), None, marks=pytest.mark.slow),
    pytest.param("deepseek", (2, 1, 2), None, marks=pytest.mark.slow),
])
def test_a_batch_decodes_as_each_prompt_alone(family, shape, use_cache):
    md = model_def_from_config(FAMILIES[family], tensor=4)
    host = distinctive_any(md, md.init(mesh_of((1, 1, 1)), seed=1))
    single = mesh_of((1, 1, 1))
    sampler = Sampler(md, single, context=CONTEXT, chunk=16)
    expected = [list(sampler.sample(host, p, max_new_tokens=NEW, stop=[]).new_tokens) for p in PROMPTS]
    assert len({tuple(e) for e in expected}) == len(PROMPTS)

    mesh = mesh_of(shape)
    decoder = BatchDecoder(md, mesh, rows=4, context=CONTEXT, chunk=4, use_cache=use_cache)
    assert decoder.use_cache == (use_cache is not False and shape[1] == 1)
    params = jax.device_put(host, md.shardings(mesh))
    got = decoder.decode(params, PROMPTS[:4], NEW) + decoder.decode(params, PROMPTS[4:], NEW)
    assert got == expected
    assert max(max(t) for t in got) < VOCAB
    assert decoder.traces == 2  # the first forward and the chunk of steps, each compiled once


def test_stopping_early_and_what_does_not_fit():
    md = model_def_from_config(FAMILIES["gpt"], tensor=1)
    mesh = mesh_of((1, 1, 1))
    params = distinctive_any(md, md.init(mesh, seed=1))
    decoder = BatchDecoder(md, mesh, rows=2, context=CONTEXT, chunk=2)
    full = decoder.decode(params, PROMPTS[:2], NEW)
    early = decoder.decode(params, PROMPTS[:2], NEW, finished=lambda row, tokens: len(tokens) >= 2)
    assert [e[:2] for e in early] == [f[:2] for f in full] and max(map(len, early)) < NEW
    with pytest.raises(ValueError, match="must fit the context of 24"):
        decoder.decode(params, [[1] * 20], NEW)
    with pytest.raises(ValueError, match="pass 1 to 2 per call"):
        decoder.decode(params, PROMPTS[:3], NEW)


@pytest.mark.parametrize("family, shape", [("gpt", (1, 1, 1)),
                                           pytest.param("llama", (2, 1, 2), marks=pytest.mark.slow)])
def test_sampled_rows_are_the_samplers_whatever_the_batch(family, shape):
    md = model_def_from_config(FAMILIES[family], tensor=4)
    single = mesh_of((1, 1, 1))
    params = distinctive_any(md, md.init(single, seed=1))
    sampler = Sampler(md, single, context=CONTEXT, chunk=16)
    mesh = mesh_of(shape)  # rows split over data, weights over tensor, with their keys
    decoder = BatchDecoder(md, mesh, rows=4, context=CONTEXT, chunk=4)
    seeds = [11, 22, 33, 44, 55]
    settings = {"temperature": 1.5, "top_k": 40, "top_p": 0.9}
    expected = [list(sampler.sample(params, p, max_new_tokens=NEW, stop=[], seed=s, **settings).new_tokens)
                for p, s in zip(PROMPTS, seeds, strict=True)]
    greedy = [list(sampler.sample(params, p, max_new_tokens=NEW, stop=[]).new_tokens) for p in PROMPTS]
    assert all(e != g for e, g in zip(expected, greedy, strict=True))  # it did sample
    got = (decoder.decode(params, PROMPTS[:4], NEW, seeds=seeds[:4], **settings)
           + decoder.decode(params, PROMPTS[4:], NEW, seeds=seeds[4:], **settings))
    assert got == expected
    # another batch composition and order: each row keeps its tokens
    order = [4, 2, 0]
    assert decoder.decode(params, [PROMPTS[i] for i in order], NEW, seeds=[seeds[i] for i in order],
                          **settings) == [expected[i] for i in order]
    other = decoder.decode(params, PROMPTS[:4], NEW, seeds=[s + 1 for s in seeds[:4]], **settings)
    assert other != got[:4]
    assert decoder.decode(params, PROMPTS[:4], NEW, seeds=seeds[:4], temperature=0.0) == greedy[:4]
    assert decoder.decode(params, PROMPTS[:4], NEW, seeds=seeds[:4], temperature=2.0, top_k=1) == greedy[:4]
    assert decoder.traces == 2  # sampling settings and seeds are run-time values
    with pytest.raises(ValueError, match="^top_p: must be a number in"):
        decoder.decode(params, PROMPTS[:2], NEW, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="^seeds: give one integer"):
        decoder.decode(params, PROMPTS[:2], NEW, seeds=[1])
