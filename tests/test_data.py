"""Data: built-in corpus, deterministic resumable batches, per-shard construction, bad input."""

import hashlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.config import ConfigError, DataConfig, MeshConfig
from meshtron.data import BatchStream, Corpus, builtin_text
from meshtron.mesh import build_mesh


def corpus(**kw):
    return Corpus.from_config(DataConfig(**kw), seq_len=32, batch_size=8, vocab_size=256)


def test_builtin_corpus_is_the_same_bytes_on_every_python():
    """The default run trains on the shipped text, not the running Python's pydoc topics (which differ
    between CPython releases: 3.12.1's are 6% longer)."""
    text = builtin_text().encode("utf-8")
    assert len(text) == 466_273
    assert hashlib.sha256(text).hexdigest() == "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"
    if sys.version_info[:3] == (3, 11, 7):  # where it came from
        from pydoc_data.topics import topics

        assert text == "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    assert corpus().source == "built-in (CPython 3.11.7 pydoc topics)"


def test_builtin_corpus_split_and_unigram_baseline():
    c = corpus()
    assert len(c.train) > 400_000 and len(c.heldout) > 40_000
    assert 2.5 < c.unigram_loss() < 5.55  # bytes of English prose: well below log(256)


def test_batches_are_deterministic_and_resume_from_position():
    c = corpus()
    a = BatchStream(c.train, batch_size=8, seq_len=32, seed=3)
    first = [a.global_batch(i) for i in range(5)]
    resumed = BatchStream(c.train, batch_size=8, seq_len=32, seed=3, position=3)
    np.testing.assert_array_equal(resumed.global_batch(resumed.position), first[3])
    assert not np.array_equal(first[0], first[1])
    other_seed = BatchStream(c.train, batch_size=8, seq_len=32, seed=4)
    assert not np.array_equal(other_seed.global_batch(0), first[0])


def test_sharded_batch_builds_each_shard_from_its_own_rows():
    c = corpus()
    mesh = build_mesh(MeshConfig(4, 1, 2))
    stream = BatchStream(c.train, batch_size=8, seq_len=32, seed=0)
    asked = []
    original = stream.rows
    stream.rows = lambda index, rows: asked.append(rows) or original(index, rows)
    array = stream.next(NamedSharding(mesh, P("data", None)))
    assert {(s.start, s.stop) for s in asked} == {(0, 2), (2, 4), (4, 6), (6, 8)}
    assert stream.position == 1 and array.shape == (8, 33)
    np.testing.assert_array_equal(jax.device_get(array), stream.global_batch(0))


def test_text_file_and_bad_data_inputs(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 400)
    assert len(corpus(path=str(text)).train) == int(len("hello world " * 400) * 0.9)
    with pytest.raises(ConfigError, match="data.path: .* does not exist"):
        corpus(path=str(tmp_path / "nope.txt"))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ConfigError, match=r"fewer than one batch \(8 x 33 = 264\)"):
        corpus(path=str(short))
    with pytest.raises(ConfigError, match="model.vocab_size"):
        Corpus.from_config(DataConfig(), seq_len=32, batch_size=8, vocab_size=100)
