"""Megatron-LM indexed token datasets: the format (against files Megatron-core wrote), preprocessing,
GPT-style sample windows, held-out split, resumption and blending. No JAX, no torch."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshtron.config import ConfigError
from meshtron.data.blend import BlendedSamples, blend_indices, parse_blend
from meshtron.data.indexed import (
    HEADER,
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    write_dataset,
)
from meshtron.data.preprocess import preprocess
from meshtron.data.samples import TokenWindows
from meshtron.data.tokenizers import load_tokenizer, train_bpe

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_indexed"
TOKENS = json.loads((FIXTURES / "tokens.json").read_text())
NAMES = ["uint16_docs", "int32_sentences"]


def copy_fixture(name: str, directory: Path) -> str:
    for suffix in (".bin", ".idx"):
        shutil.copy(FIXTURES / f"{name}{suffix}", directory / f"{name}{suffix}")
    return str(directory / name)


def random_dataset(path: Path, documents: int, *, seed: int = 0, low: int = 1, high: int = 200, vocab: int = 1000):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high, size=documents)
    tokens = rng.integers(0, vocab, size=int(lengths.sum()))
    with IndexedDatasetWriter(path, best_dtype(vocab)) as writer:
        writer.add_documents(tokens, lengths)
    return IndexedDataset(path), tokens, lengths


# -- the format -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_reads_what_megatron_wrote(name):
    entry = TOKENS[name]
    ds = IndexedDataset(FIXTURES / name)
    sequences = [s for doc in entry["documents"] for s in doc]
    assert ds.dtype == np.dtype(entry["dtype"])
    assert len(ds) == ds.num_sequences == len(sequences)
    assert ds.num_documents == len(entry["documents"])
    assert ds.sequence_lengths.tolist() == [len(s) for s in sequences]
    assert ds.document_indices.tolist() == [0, *np.cumsum([len(d) for d in entry["documents"]]).tolist()]
    assert ds.total_tokens == sum(map(len, sequences))
    assert [ds.get(i).tolist() for i in range(len(ds))] == sequences
    assert [ds.document(d).tolist() for d in range(ds.num_documents)] == [[t for s in d for t in s]
                                                                          for d in entry["documents"]]
    longest = max(range(len(sequences)), key=lambda i: len(sequences[i]))
    assert ds.get(longest, offset=3, length=5).tolist() == sequences[longest][3:8]
    assert ds.get(longest, offset=4).tolist() == sequences[longest][4:]
    assert ds[-1].tolist() == sequences[-1]
    with pytest.raises(IndexError):
        ds.get(longest, offset=1, length=len(sequences[longest]))
    assert pickle.loads(pickle.dumps(ds)).get(0).tolist() == sequences[0]


def test_writer_is_byte_identical_to_megatron(tmp_path):
    for name in NAMES:
        entry = TOKENS[name]
        with IndexedDatasetWriter(tmp_path / name, entry["dtype"]) as writer:
            for sequences in entry["documents"]:
                if len(sequences) == 1 or not sequences:
                    writer.add_document(sequences[0] if sequences else [])
                else:
                    for sequence in sequences:
                        writer.add_sequence(sequence)
                    writer.end_document()
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"{name}{suffix}").read_bytes() == (FIXTURES / f"{name}{suffix}").read_bytes()
    # the batched path writes the same (uint16_docs: one sequence or none per document)
    docs = [d[0] if d else [] for d in TOKENS["uint16_docs"]["documents"]]
    with IndexedDatasetWriter(tmp_path / "batched", np.uint16) as writer:
        writer.add_documents(np.concatenate([np.asarray(d, np.int64) for d in docs]), [len(d) for d in docs])
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"batched{suffix}").read_bytes() == (FIXTURES / f"uint16_docs{suffix}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp") == []


def test_best_dtype_is_megatrons_rule():
    assert best_dtype(256) == np.uint16 and best_dtype(8192) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(128256) == np.int32 and best_dtype(None) == np.int32


def test_writer_refuses_ids_beyond_dtype_and_leaves_nothing(tmp_path):
    with (pytest.raises(ConfigError, match="token id 70000 does not fit its dtype uint16"),
          IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer):
        writer.add_document([1, 2, 3])
        writer.add_document([70000])
    assert list(tmp_path.iterdir()) == []


def _corrupt(tmp_path, change) -> str:
    prefix = copy_fixture("uint16_docs", tmp_path)
    change(Path(prefix + ".idx"), Path(prefix + ".bin"))
    return prefix


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("change, message", [
    (lambda idx, bin_: _patch(idx, 0, b"NOTMAGIC!"), r"uint16_docs\.idx.*not the MMIDIDX magic.*not a Megatron"),
    (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-10]),
     r"uint16_docs\.bin.*has 1812 bytes but .* points at 1822 .*truncated.*copy both files again"),
    (lambda idx, bin_: _patch(idx, 17, bytes([9])), r"uint16_docs\.idx.*unknown dtype code 9 .*8 uint16"),
    (lambda idx, bin_: bin_.unlink(), r"uint16_docs\.bin.*does not exist.*PREFIX\.bin \+ PREFIX\.idx"),
    (lambda idx, bin_: idx.unlink(), r"uint16_docs\.idx.*does not exist.*meshtron preprocess"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8]), r"uint16_docs\.idx.*needs 258 \(truncated or corrupt\)"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), r"shorter than the 34-byte header"),
    (lambda idx, bin_: _patch(idx, 9, struct.pack("<Q", 2)), r"format version 2"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes() + bytes(10)), r"multimodal dataset.*text token datasets only"),
    (lambda idx, bin_: _patch(idx, HEADER.size + 40 + 8, struct.pack("<q", 4)), r"sequence 1 points at byte 4"),
])
def test_bad_files_are_one_line_errors(tmp_path, change, message):
    prefix = _corrupt(tmp_path, change)
    with pytest.raises(ConfigError, match=message) as err:
        IndexedDataset(prefix)
    assert "\n" not in str(err.value)


def test_prefix_may_carry_a_suffix():
    assert IndexedDataset(str(FIXTURES / "uint16_docs.bin")).num_documents == 12


# -- preprocessing ----------------------------------------------------------------------------------

WORDS = ["the", "model", "reads", "tokens", "from", "memory", "maps", "while", "seven", "workers", "write",
         "documents", "in", "order", "and", "every", "sample", "crosses", "boundaries", "between", "shuffled"]


def make_texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=int(n))) for n in rng.integers(0, 60, size=count)]
    texts[3] = "Ünïcödé — “quoted” text\nwith a newline"
    return texts


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    (directory / "train.txt").write_text("\n".join(make_texts(400, seed=1)), encoding="utf-8")
    return train_bpe([directory / "train.txt"], 300, directory / "tokenizer.json")


def test_preprocess_matches_the_tokenizer_with_two_workers(tmp_path, bpe):
    texts = make_texts(300)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[:200])))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[200:]) + "\n\n")
    (tmp_path / "c.txt").write_text("a whole file is one document\n\nof two paragraphs\n", encoding="utf-8")
    inputs = [str(tmp_path / "*.jsonl"), tmp_path / "c.txt"]
    stats = preprocess(inputs, bpe.path, tmp_path / "out2", workers=2, progress=False)
    expected = [bpe.encode(t) for t in [*texts, (tmp_path / "c.txt").read_text(encoding="utf-8")]]
    expected = [ids + [bpe.eod] if ids else [] for ids in expected]
    ds = IndexedDataset(tmp_path / "out2")
    assert ds.dtype == np.uint16 and bpe.eod == 0
    assert [ds.document(d).tolist() for d in range(ds.num_documents)] == expected
    assert (stats.documents, stats.tokens, stats.files) == (len(expected), sum(map(len, expected)), 3)
    assert any(not e for e in expected)  # an empty text: a document of no sequences, as Megatron writes
    # one worker (in this process) writes the same bytes
    preprocess(inputs, bpe, tmp_path / "out1", workers=1, progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"out1{suffix}").read_bytes() == (tmp_path / f"out2{suffix}").read_bytes()


def test_preprocess_bytes_has_no_eod_and_reports(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "héllo"}) + "\n" + json.dumps({"body": "ab"}) + "\n")
    stats = preprocess(tmp_path / "d.jsonl", "bytes", tmp_path / "bytes", json_key="body")
    ds = IndexedDataset(tmp_path / "bytes")
    assert [ds.get(i).tolist() for i in range(len(ds))] == [list("héllo".encode()), [97, 98]]
    assert ds.dtype == np.uint16
    assert stats.summary() in capsys.readouterr().out
    assert stats.mb_per_s > 0 and stats.tokens_per_s > 0 and stats.as_dict()["tokens"] == 8


@pytest.mark.parametrize("content, message", [
    (b'{"text": "ok"}\n{"title": "no text"}\n', r"bad\.jsonl:2 has no 'text' field \(title\); pass --json-key"),
    (b'{"text": "ok"}\n\n{"text": broken}\n', r"bad\.jsonl:3 is not JSON \(Expecting value at column 10\)"),
    (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', r"bad\.jsonl:2 is not UTF-8 \(invalid start byte at byte 10\); convert"),
    (b'{"text": ["a", "b"]}\n', r"bad\.jsonl:1: field 'text' is a JSON list, not a string"),
])
def test_preprocess_errors_name_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(ConfigError, match=message) as err:
        preprocess([tmp_path / "bad.jsonl"], "bytes", tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no output, not even half of one


def test_preprocess_input_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"--input: '.*/nothing-\*\.jsonl' matches no file"):
        preprocess([str(tmp_path / "nothing-*.jsonl")], "bytes", tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="is a directory"):
        preprocess([tmp_path], "bytes", tmp_path / "out", progress=False)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.txt is not UTF-8 \(unexpected end of data at byte 3\); convert"):
        preprocess([tmp_path / "latin1.txt"], "bytes", tmp_path / "out", progress=False)


# -- samples ------------------------------------------------------------------------------------------

def stream(ds: IndexedDataset, documents) -> np.ndarray:
    return np.concatenate([ds.document(int(d)) for d in documents]).astype(np.int32)


def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path):
    ds, _, _ = random_dataset(tmp_path / "d", 60)
    seq_len = 37
    windows = TokenWindows(ds, seq_len=seq_len, seed=3, holdout_fraction=0.1, num_samples=None)
    per_epoch = windows.samples_per_epoch
    assert per_epoch == (windows.tokens_per_epoch - 1) // seq_len and len(windows) == per_epoch
    order = windows.epoch_documents(0)
    assert sorted(order.tolist()) == list(range(54)) and order.tolist() != list(range(54))  # shuffled
    tokens = stream(ds, order)
    starts = []
    for i in range(per_epoch):
        epoch, start = windows.window(i)
        assert epoch == 0
        np.testing.assert_array_equal(windows.sample(i), tokens[start : start + seq_len + 1])
        starts.append(start)
    assert sorted(starts) == [j * seq_len for j in range(per_epoch)]  # every window of the epoch, once
    assert starts != sorted(starts)  # in a shuffled order
    # consecutive windows overlap by one token: the last target of one is the first input of the next
    by_start = {s: windows.sample(i) for i, s in enumerate(starts)}
    assert all(by_start[j * seq_len][-1] == by_start[(j + 1) * seq_len][0] for j in range(per_epoch - 1))
    assert windows.sample(0).dtype == np.int32 and windows.sample(0).shape == (seq_len + 1,)


def test_epochs_repeat_in_new_orders_and_num_samples_does_not_change_the_sequence(tmp_path):
    ds, _, _ = random_dataset(tmp_path / "d", 40)
    short = TokenWindows(ds, seq_len=16, seed=5, num_samples=10)
    per_epoch = short.samples_per_epoch
    long = TokenWindows(ds, seq_len=16, seed=5, num_samples=3 * per_epoch + 7)
    np.testing.assert_array_equal(short.samples(range(10)), long.samples(range(10)))
    assert long.epoch_documents(0).tolist() != long.epoch_documents(1).tolist()
    for epoch in (1, 3):
        tokens = stream(ds, long.epoch_documents(epoch))
        i = epoch * per_epoch + 2
        assert long.window(i)[0] == epoch
        np.testing.assert_array_equal(long.sample(i), tokens[long.window(i)[1] :][:17])
    with pytest.raises(IndexError):
        long.sample(len(long))


def test_samples_are_deterministic_across_instances_and_processes(tmp_path):
    ds, _, _ = random_dataset(tmp_path / "d", 50)
    a = TokenWindows(tmp_path / "d", seq_len=20, seed=11, num_samples=500)
    b = pickle.loads(pickle.dumps(TokenWindows(IndexedDataset(tmp_path / "d"), seq_len=20, seed=11, num_samples=500)))
    picks = [0, 1, 77, 199, 200, 350, 499]
    np.testing.assert_array_equal(a.samples(picks), b.samples(picks))
    assert not np.array_equal(a.samples(picks), TokenWindows(ds, seq_len=20, seed=12, num_samples=500).samples(picks))
    code = ("import sys, numpy as np; from meshtron.data.samples import TokenWindows; "
            "w = TokenWindows(sys.argv[1], seq_len=20, seed=11, num_samples=500); "
            f"print(w.samples({picks}).tolist())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == a.samples(picks).tolist()


def test_resuming_by_sample_index_continues_the_same_sequence(tmp_path):
    random_dataset(tmp_path / "d", 30)
    total, stop = 120, 47  # past the end of the first epoch

    def run(first: int, count: int) -> list:
        windows = TokenWindows(tmp_path / "d", seq_len=24, seed=7, num_samples=total)  # a fresh process's view
        return [windows.sample(i).tolist() for i in range(first, first + count)]

    assert TokenWindows(tmp_path / "d", seq_len=24, seed=7).samples_per_epoch < total
    uninterrupted = run(0, total)
    assert run(0, stop) + run(stop, total - stop) == uninterrupted


def test_heldout_split_is_disjoint_from_training_documents(tmp_path):
    ds, _, _ = random_dataset(tmp_path / "d", 40)
    train = TokenWindows(ds, seq_len=16, seed=1, split="train", holdout_fraction=0.1)
    held = TokenWindows(ds, seq_len=16, seed=1, split="heldout", holdout_fraction=0.1)
    assert held.documents.tolist() == [36, 37, 38, 39] and train.documents.tolist() == list(range(36))
    assert set(held.epoch_documents(0).tolist()).isdisjoint(train.epoch_documents(0).tolist())
    tokens = stream(ds, held.epoch_documents(0))
    for i in range(len(held)):
        start = held.window(i)[1]
        np.testing.assert_array_equal(held.sample(i), tokens[start : start + 17])
    again = TokenWindows(ds, seq_len=16, seed=1, split="heldout", holdout_fraction=0.1)
    np.testing.assert_array_equal(held.samples(range(len(held))), again.samples(range(len(held))))
    assert TokenWindows(ds, seq_len=16, seed=1, split="heldout", holdout_fraction=0.001).documents.tolist() == [39]


def test_sample_errors(tmp_path):
    write_dataset(tmp_path / "tiny", [[1, 2, 3], [4, 5], [6]], np.uint16)
    with pytest.raises(ConfigError, match=r"the train split of .*tiny' \(2 documents\) has 5 tokens, fewer than one "
                                          r"sample of seq_len \+ 1 = 9"):
        TokenWindows(tmp_path / "tiny", seq_len=8, seed=0, holdout_fraction=0.2)
    with pytest.raises(ConfigError, match="data.holdout_fraction: is 0, so .* has no held-out documents"):
        TokenWindows(tmp_path / "tiny", seq_len=2, seed=0, split="heldout", holdout_fraction=0.0)
    with pytest.raises(ConfigError, match="data.holdout_fraction: 0.9 of .*'s 3 documents leaves none for training"):
        TokenWindows(tmp_path / "tiny", seq_len=2, seed=0, holdout_fraction=0.9)
    assert TokenWindows(tmp_path / "tiny", seq_len=2, seed=0, holdout_fraction=0.0).num_documents == 3


def test_a_million_documents_index_in_seconds(tmp_path):
    ds, _, _ = random_dataset(tmp_path / "big", 1_000_000, low=1, high=8)
    start = time.perf_counter()
    windows = TokenWindows(ds, seq_len=128, seed=0, num_samples=100_000)
    windows.sample(99_999)
    windows.sample(0)
    assert time.perf_counter() - start < 5.0
    assert windows.num_documents == 900_000


# -- blending -------------------------------------------------------------------------------------------

def test_blend_indices_equal_megatrons():
    for entry in json.loads((FIXTURES / "blend.json").read_text())["blends"]:
        dataset_index, sample_index = blend_indices(entry["weights"], entry["size"])
        assert dataset_index.tolist() == entry["dataset_index"]
        assert sample_index.tolist() == entry["dataset_sample_index"]


def test_blend_proportions_and_determinism(tmp_path):
    for k in range(3):
        random_dataset(tmp_path / f"d{k}", 30, seed=k)
    blend = [0.2, str(tmp_path / "d0"), "0.3", str(tmp_path / "d1"), 5, str(tmp_path / "d2")]  # 0.5 once normalised
    blended = BlendedSamples.from_blend(blend, seq_len=16, seed=2, num_samples=10_000)
    shares = np.bincount(blended.dataset_index, minlength=3) / 10_000
    assert np.allclose(blended.weights, [0.2 / 5.5, 0.3 / 5.5, 5 / 5.5])
    np.testing.assert_allclose(shares, blended.weights, atol=0.01)
    even = BlendedSamples.from_blend([0.2, blend[1], 0.3, blend[3], 0.5, blend[5]], seq_len=16, seed=2,
                                     num_samples=10_000)
    np.testing.assert_allclose(np.bincount(even.dataset_index) / 10_000, [0.2, 0.3, 0.5], atol=0.01)
    for i in (0, 1, 2, 9_999, 4_321):
        d, k = even.source(i)
        np.testing.assert_array_equal(even.sample(i), even.datasets[d].sample(k))
    again = BlendedSamples.from_blend([0.2, blend[1], 0.3, blend[3], 0.5, blend[5]], seq_len=16, seed=2,
                                      num_samples=12_000)
    assert again.dataset_index[:10_000].tolist() == even.dataset_index.tolist()  # online: a longer run extends it
    np.testing.assert_array_equal(again.samples(range(0, 10_000, 997)), even.samples(range(0, 10_000, 997)))
    datasets = [TokenWindows(tmp_path / "d0", seq_len=16, seed=2, num_samples=3)] * 2
    with pytest.raises(ConfigError, match=r"draws 5 samples from dataset 0 .* but it has 3; build it with"):
        BlendedSamples([1, 1], datasets, 10)


@pytest.mark.parametrize("blend, message", [
    ([0.5, "a", 0.5], r"data\.blend: has 3 entries, an odd number; give \[w1, prefix1"),
    (["heavy", "a", 1, "b"], r"data\.blend: entry 0 \('heavy'\) is not a number"),
    ([0.5, "a", -1, "b"], r"data\.blend: weight -1 \(entry 2\) must be a finite number >= 0"),
    ([0, "a", 0.0, "b"], r"data\.blend: every weight is 0"),
    ([0.3, 0.7], r"data\.blend: entry 1 \(0\.7\) should be the prefix of an indexed dataset"),
    ([0.3, ""], r"data\.blend: entry 1 \(''\) should be the prefix"),
    ([], r"data\.blend: is empty"),
    ("0.3 a", r"data\.blend: expected a list"),
])
def test_parse_blend_errors(blend, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_blend(blend)
    assert "\n" not in str(err.value)


def test_parse_blend():
    parsed = parse_blend(["30", " data/a ", 70, "data/b"])
    assert parsed.prefixes == ["data/a", "data/b"] and parsed.weights == [0.3, 0.7]
    weights, prefixes = parsed
    assert (weights, prefixes) == ([0.3, 0.7], ["data/a", "data/b"])
    assert load_tokenizer("bytes").eod is None  # (the byte tokenizer appends nothing, see preprocess)
