"""Supervised fine-tuning data and packed pretraining documents: the chat template and its loss mask,
the files ``meshtron preprocess --sft`` writes, windows of whole examples, document windows over a
pretraining stream, and training on them (blended, resumed, on a pipeline)."""

import json

import numpy as np
import pytest

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.data.blend import BlendedSamples
from meshtron.data.indexed import IndexedDataset, write_dataset
from meshtron.data.samples import TokenWindows
from meshtron.data.sft import ChatTemplate, PackedExamples, mask_prefix, preprocess_sft
from meshtron.data.tokenizers import load_tokenizer
from meshtron.errors import ConfigError
from meshtron.train.loop import Trainer

BYTES = load_tokenizer("bytes")


def examples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        word = "".join(rng.choice(list("abcdef"), size=int(rng.integers(2, 7))))
        if i % 2:
            out.append({"prompt": f"reverse {word}", "response": word[::-1]})
        else:
            out.append({"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": f"copy {word}"},
                                     {"role": "assistant", "content": word}]})
    return out


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_template_counts_the_answer_and_its_end_only():
    template = ChatTemplate(BYTES)
    ids, mask = template.render([{"role": "user", "content": "copy ab"}, {"role": "assistant", "content": "ab"}])
    text = bytes(ids.tolist()).decode()
    assert text == "<|user|>\ncopy ab\n<|assistant|>\nab<|end|>"
    assert bytes(ids[mask == 1].tolist()).decode() == "ab<|end|>"
    assert template.prompt("copy ab") == list(b"<|user|>\ncopy ab\n<|assistant|>\n")
    assert template.answer(list(b"ba<|end|>junk")) == "ba"


def test_preprocess_writes_tokens_and_a_matching_loss_mask(tmp_path):
    src = write_jsonl(tmp_path / "sft.jsonl", examples(10))
    main(["preprocess", "--sft", "--input", src, "--tokenizer", "bytes", "--output", str(tmp_path / "sft")])
    tokens, masks = IndexedDataset(tmp_path / "sft"), IndexedDataset(mask_prefix(tmp_path / "sft"))
    assert tokens.num_documents == masks.num_documents == 10
    for k, record in enumerate(examples(10)):
        ids, mask = tokens.document(k), masks.document(k)
        answer = record["response"] if "response" in record else record["messages"][-1]["content"]
        assert bytes(ids[mask == 1].tolist()).decode() == answer + "<|end|>"


@pytest.mark.parametrize("line, message", [
    ({"text": "x"}, "has neither 'messages' nor 'prompt' and 'response'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\] must be"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
])
def test_a_bad_example_is_one_line_naming_the_file_and_line_and_nothing_is_written(tmp_path, line, message):
    src = write_jsonl(tmp_path / "bad.jsonl", [*examples(2), line])
    with pytest.raises(ConfigError, match=message) as err:
        preprocess_sft(src, "bytes", tmp_path / "out", progress=False)
    assert "bad.jsonl:3" in str(err.value)
    assert not list(tmp_path.glob("out*"))


def test_windows_hold_whole_examples_each_its_own_document_every_example_once_an_epoch(tmp_path):
    preprocess_sft(write_jsonl(tmp_path / "sft.jsonl", examples(40)), "bytes", tmp_path / "sft", progress=False)
    lengths = np.diff(IndexedDataset(tmp_path / "sft").document_token_offsets())
    windows = PackedExamples(tmp_path / "sft", seq_len=63, seed=3, holdout_fraction=0.0, num_samples=100)
    seen = []
    for i in range(windows.samples_per_epoch):
        w = windows.sample(i)
        assert w.shape == (64, 3)
        segments = w[:, 1]
        ids = sorted(set(segments.tolist()) - {0})
        assert ids == list(range(1, len(ids) + 1))  # numbered in order
        assert (np.diff(segments[segments > 0]) >= 0).all()
        padded = segments == 0
        assert not padded.any() or padded[np.argmax(padded):].all()  # padding only at the end
        seen += [int((segments == s).sum()) for s in ids]
    assert sorted(seen) == sorted(np.minimum(lengths, 64).tolist())  # every example once, whole or cut to a window
    again = PackedExamples(tmp_path / "sft", seq_len=63, seed=3, holdout_fraction=0.0, num_samples=100)
    np.testing.assert_array_equal(windows.sample(77), again.sample(77))  # a later epoch, rebuilt the same


def test_document_windows_over_a_pretraining_stream_number_each_document(tmp_path):
    write_dataset(tmp_path / "docs", [np.arange(5), np.arange(100, 103), np.arange(200, 210)])
    plain = TokenWindows(tmp_path / "docs", seq_len=6, seed=0, holdout_fraction=0.0)
    docs = TokenWindows(tmp_path / "docs", seq_len=6, seed=0, holdout_fraction=0.0, reset_per_document=True)
    for i in range(len(plain)):
        w = docs.sample(i)
        np.testing.assert_array_equal(w[:, 0], plain.sample(i))
        assert (w[:, 2] == 1).all() and w[0, 1] == 1
        # within a document the tokens count up by one: a new number exactly where they do not
        starts = w[1:, 0] != w[:-1, 0] + 1
        np.testing.assert_array_equal(np.diff(w[:, 1]), starts.astype(int))


def test_a_text_corpus_cannot_reset_per_document():
    with pytest.raises(ConfigError, match="data.reset_per_document: the built-in corpus is one text"):
        Trainer.from_config(load_config(None, ["data.reset_per_document=true", "train.steps=1"]))


MODEL = ["model.family=llama", "model.kv_heads=2", "model.layers=4", "model.hidden=32", "model.heads=4",
         "model.mlp_dim=64", "model.seq_len=64", "model.vocab_size=256", "train.batch_size=8", "train.warmup_steps=1",
         "train.eval_every=1000", "train.eval_batches=1", "parallel.microbatches=2", "train.steps=3"]


@pytest.mark.slow
def test_sft_data_blended_with_pretraining_documents_trains_alike_on_a_pipeline(tmp_path):
    preprocess_sft(write_jsonl(tmp_path / "sft.jsonl", examples(200)), "bytes", tmp_path / "sft", progress=False)
    rng = np.random.default_rng(0)
    write_dataset(tmp_path / "web", [rng.integers(0, 256, size=int(rng.integers(5, 80))) for _ in range(300)],
                  dtype=np.uint16)
    data = [f"data.blend=[0.7,{tmp_path / 'sft'},0.3,{tmp_path / 'web'}]"]
    one = Trainer.from_config(load_config(None, [*MODEL, *data, "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1"]))
    assert isinstance(one.corpus.train, BlendedSamples)
    assert one.train_stream().channels == (3,)
    reference = one.run()
    piped = Trainer.from_config(load_config(None, [*MODEL, *data, "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                                                   "parallel.schedule=zb-h1"])).run()
    np.testing.assert_allclose(piped.losses, reference.losses, rtol=2e-5)
    assert np.isfinite(reference.losses).all()


def test_the_loss_counts_the_answers_alone(tmp_path):
    """Through the train step's features, the targets with a loss weight are exactly the answers' tokens
    and their end markers: no prompt, header, padding or next example's token."""
    import jax.numpy as jnp

    from meshtron.models import documents

    records = examples(30)
    preprocess_sft(write_jsonl(tmp_path / "sft.jsonl", records), "bytes", tmp_path / "sft", progress=False)
    windows = PackedExamples(tmp_path / "sft", seq_len=127, seed=0, holdout_fraction=0.0)
    answers = sorted((r["response"] if "response" in r else r["messages"][-1]["content"]) + "<|end|>" for r in records)
    counted = []
    for i in range(windows.samples_per_epoch):
        seen = documents.view(documents.document_features(jnp.asarray(windows.sample(i)[None])))
        targets, weights, segments = (np.asarray(x)[0] for x in (seen.targets, seen.weights, seen.segments))
        for s in set(segments.tolist()) - {0}:
            picked = targets[(segments == s) & (weights > 0)]
            counted.append(bytes(picked.tolist()).decode())
    assert sorted(counted) == answers
