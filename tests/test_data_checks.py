"""What the data side refuses before a run wastes its time, in one line each: an empty input to
``meshtron preprocess`` (and nothing half-written: the old files stay byte for byte), SFT examples
whose answers fall outside the window, data tokenized with another tokenizer than the run's (the
``PREFIX.meta.json`` sidecar), a ``model.vocab_size`` grown past a checkpoint's, and SFT lines
without an answer; and ``--no-eod`` for SFT data."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from meshtron.config import DataConfig, load_config
from meshtron.data.indexed import IndexedDataset, IndexedDatasetWriter, meta_path, read_meta, write_dataset
from meshtron.data.preprocess import preprocess
from meshtron.data.sft import PackedExamples, check_answers, mask_prefix, preprocess_sft
from meshtron.data.sources import check_data_tokenizer, load_training_data
from meshtron.data.tokenizers import file_sha256, load_tokenizer, train_bpe
from meshtron.errors import ConfigError

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "tired", "owls",
         "watch", "from", "an", "old", "oak", "tree"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A 300-id byte-level BPE (``<|endoftext|>`` is id 0)."""
    directory = tmp_path_factory.mktemp("bpe")
    rng = np.random.default_rng(0)
    (directory / "train.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(300)))
    return train_bpe([directory / "train.txt"], 300, directory / "tokenizer.json")


def texts(path: Path, count: int = 20) -> Path:
    rng = np.random.default_rng(1)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, 8))}) + "\n" for _ in range(count)))
    return path


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def load(path, *, seq_len: int = 16, vocab_size: int = 256, tokenizer: str = "bytes", init_from=None,
         blend=None, holdout: float = 0.25):
    cfg = DataConfig(path=None if path is None else str(path), tokenizer=str(tokenizer), blend=blend,
                     holdout_fraction=holdout)
    return load_training_data(cfg, seq_len=seq_len, batch_size=2, vocab_size=vocab_size, seed=0, samples=4,
                              eval_samples=2, init_from=None if init_from is None else str(init_from))


def fake_checkpoint(directory: Path, vocab_size: int, tokenizer=None) -> Path:
    """A checkpoint directory as the data side sees it: step 0's meta record (the model's config) and the
    tokenizer file it carries (none: bytes)."""
    (directory / "0" / "meta").mkdir(parents=True)
    meta = {"config": {"model": {"vocab_size": vocab_size}}, "imported": {"from": "huggingface"}}
    (directory / "0" / "meta" / "metadata").write_text(json.dumps(meta))
    if tokenizer is not None:
        shutil.copyfile(tokenizer.path, directory / "tokenizer.json")
    return directory


# -- A: an empty input is an error, and nothing is half-written ------------------------------------------------

@pytest.mark.parametrize("content, held", [
    ("", "no document"),
    ("\n  \n\n", "no document"),
    ('{"text": ""}\n{"text": ""}\n', "only 2 empty documents"),
])
def test_preprocess_of_an_empty_input_is_an_error_and_the_old_dataset_stays_byte_identical(tmp_path, content, held):
    out = tmp_path / "out"
    out.mkdir()
    preprocess(texts(tmp_path / "good.jsonl"), "bytes", out / "data", progress=False)
    before = digests(out)
    assert sorted(before) == ["data.bin", "data.idx", "data.meta.json"]
    (tmp_path / "empty.jsonl").write_text(content)
    with pytest.raises(ConfigError, match=rf"^--input: .*empty\.jsonl holds {held} \(empty, or blank lines only\); "
                                          r"give files with text \(nothing was written\)$"):
        preprocess(tmp_path / "empty.jsonl", "bytes", out / "data", progress=False)
    assert digests(out) == before  # no temporary file left either


def test_sft_preprocess_of_an_empty_input_is_an_error_and_all_five_files_stay_byte_identical(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    preprocess_sft(write_jsonl(tmp_path / "good.jsonl", [{"prompt": "copy ab", "response": "ab"}] * 3), "bytes",
                   out / "sft", progress=False)
    before = digests(out)
    assert sorted(before) == ["sft.bin", "sft.idx", "sft.loss_mask.bin", "sft.loss_mask.idx", "sft.meta.json"]
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"^--input: .*empty\.jsonl holds no example \(empty, or blank lines only\); "
                                          r"write one JSON example per line \(nothing was written\)$"):
        preprocess_sft(tmp_path / "empty.jsonl", "bytes", out / "sft", progress=False)
    assert digests(out) == before


def test_a_failed_write_of_the_loss_mask_leaves_both_old_pairs_intact(tmp_path, monkeypatch):
    """The SFT writer writes two datasets: every file goes in under a temporary name, and none is renamed
    until all are complete."""
    out = tmp_path / "out"
    out.mkdir()
    preprocess_sft(write_jsonl(tmp_path / "old.jsonl", [{"prompt": "copy ab", "response": "ab"}] * 3), "bytes",
                   out / "sft", progress=False)
    before = digests(out)
    write_index = IndexedDatasetWriter.write_index

    def failing(self):
        if self.prefix.endswith(".loss_mask"):
            raise OSError("No space left on device")
        write_index(self)

    monkeypatch.setattr(IndexedDatasetWriter, "write_index", failing)
    with pytest.raises(OSError, match="No space left"):
        preprocess_sft(write_jsonl(tmp_path / "new.jsonl", [{"prompt": "copy cd", "response": "cd"}] * 5), "bytes",
                       out / "sft", progress=False)
    assert digests(out) == before


def test_a_sidecar_is_dropped_with_the_files_it_described_and_a_stale_one_is_ignored(tmp_path):
    preprocess(texts(tmp_path / "a.jsonl"), "bytes", tmp_path / "data", progress=False)
    assert read_meta(IndexedDataset(tmp_path / "data"))["tokenizer"] == {"kind": "bytes"}
    sidecar = meta_path(tmp_path / "data").read_text()
    write_dataset(tmp_path / "data", [[1, 2, 3]], np.uint16)  # a writer that records no tokenizer
    assert not meta_path(tmp_path / "data").exists()
    meta_path(tmp_path / "data").write_text(sidecar)  # put back over other files (as a Megatron tool would leave it)
    assert read_meta(IndexedDataset(tmp_path / "data")) is None  # its counts are not these files'


# -- B: SFT examples whose answers lie beyond the window --------------------------------------------------------

def long_prompts(path: Path, long: int, short: int) -> Path:
    """``long`` examples whose answer starts at token 24 + 40 = 64, then ``short`` at 24 + 1 = 25 (bytes:
    ``<|user|>\\n`` + prompt + ``\\n<|assistant|>\\n`` before the answer)."""
    return write_jsonl(path, [{"prompt": "x" * 40, "response": "ab"}] * long + [{"prompt": "y", "response": "cd"}] * short)


def test_where_each_answer_starts_and_how_many_a_window_cuts_off(tmp_path):
    preprocess_sft(long_prompts(tmp_path / "sft.jsonl", 4, 2), "bytes", tmp_path / "sft", progress=False)
    windows = PackedExamples(tmp_path / "sft", seq_len=32, seed=0, holdout_fraction=0.0)
    assert windows.answer_starts.tolist() == [64, 64, 64, 64, 25, 25]
    assert (windows.num_examples, windows.answers_lost) == (6, 4)
    assert PackedExamples(tmp_path / "sft", seq_len=64, seed=0, holdout_fraction=0.0).answers_lost == 0
    assert PackedExamples(tmp_path / "sft", seq_len=24, seed=0, holdout_fraction=0.0).answers_lost == 6


def test_a_run_whose_every_answer_lies_beyond_seq_len_is_refused(tmp_path):
    preprocess_sft(long_prompts(tmp_path / "sft.jsonl", 8, 0), "bytes", tmp_path / "sft", progress=False)
    with pytest.raises(ConfigError, match=r"^data\.path: every one of the 6 training examples of .*sft loses its answer "
                                          r"at model\.seq_len=32 .*; use a longer model\.seq_len \(model\.seq_len=64 "
                                          r"keeps every answer\) or shorter examples$"):
        load(tmp_path / "sft", seq_len=32)
    blend = [1, str(tmp_path / "sft"), 1, str(tmp_path / "sft")]
    with pytest.raises(ConfigError, match=r"^data\.blend: every one of the 6 training examples"):
        load(None, seq_len=32, blend=blend)


def test_a_run_where_some_answers_are_cut_off_warns_once_with_the_counts(tmp_path, capsys):
    preprocess_sft(long_prompts(tmp_path / "sft.jsonl", 3, 5), "bytes", tmp_path / "sft", progress=False)
    load(tmp_path / "sft", seq_len=32)  # the training split is the first 6 examples: 3 long, 3 short
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [(f"meshtron: data.path: 3 of 6 training examples of {tmp_path / 'sft'} lose their answer at "
                      "model.seq_len=32 (cut before their first counted token) and count for nothing; "
                      "model.seq_len=64 keeps every answer, or shorten those examples")]
    load(tmp_path / "sft", seq_len=64)
    assert capsys.readouterr().err == ""


def test_a_batch_without_a_counted_target_has_loss_weights_of_zero_not_nan():
    """What a step sees when no answer of its batch fits: weights of 0 (a loss of 0 and no gradient), never
    a division by zero; a run where that holds for every batch is refused above."""
    import jax.numpy as jnp

    from meshtron.models import documents

    windows = np.zeros((2, 9, 3), np.int32)
    windows[:, :, 0], windows[:, :, 1] = 7, 1  # one document a row, its loss mask 0 throughout
    seen = documents.view(documents.document_features(jnp.asarray(windows)))
    weights = np.asarray(seen.weights)
    assert np.isfinite(weights).all() and not weights.any()
    assert float(documents.weighted_mean(jnp.ones(weights.shape), seen.weights)) == 0.0


# -- C: the tokenizer recorded with the data -------------------------------------------------------------------

def test_preprocess_records_the_tokenizer_beside_megatrons_files(tmp_path, bpe):
    source = texts(tmp_path / "a.jsonl")
    preprocess(source, bpe.path, tmp_path / "bpe", progress=False)
    preprocess(source, "bytes", tmp_path / "bytes", progress=False)
    meta = json.loads(meta_path(tmp_path / "bpe").read_text())
    dataset = IndexedDataset(tmp_path / "bpe")
    assert meta["tokenizer"] == {"kind": "huggingface", "source": str(bpe.path), "vocab_size": 300, "eod": 0,
                                 "sha256": file_sha256(bpe.path)}
    assert (meta["documents"], meta["tokens"], meta["append_eod"]) == (20, dataset.total_tokens, True)
    assert json.loads(meta_path(tmp_path / "bytes").read_text())["tokenizer"] == {"kind": "bytes"}
    # the Megatron files are what they were without the sidecar: an indexed dataset of the same documents
    write_dataset(tmp_path / "plain", [dataset.document(d) for d in range(dataset.num_documents)], np.uint16)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"plain{suffix}").read_bytes() == (tmp_path / f"bpe{suffix}").read_bytes()


def test_data_of_another_tokenizer_is_refused_at_the_start_of_a_run(tmp_path, bpe):
    source = texts(tmp_path / "a.jsonl")
    preprocess(source, "bytes", tmp_path / "bytes", progress=False)
    preprocess(source, bpe.path, tmp_path / "bpe", progress=False)
    with pytest.raises(ConfigError, match=rf"^data\.path: .*bytes was tokenized with bytes but this run's tokenizer is "
                                          rf".*tokenizer\.json \(huggingface, 300 ids, sha256 [0-9a-f]{{12}}\) "
                                          rf"\(data\.tokenizer\); re-run meshtron preprocess with the model's tokenizer, "
                                          rf"--tokenizer {bpe.path}, into .*bytes, or set data\.tokenizer=bytes if that "
                                          r"is the model's$"):
        load(tmp_path / "bytes", tokenizer=bpe.path, vocab_size=300)
    with pytest.raises(ConfigError, match=r"^data\.path: .*bpe was tokenized with .*tokenizer\.json \(huggingface, 300 "
                                          r"ids, .*\) but this run's tokenizer is bytes \(data\.tokenizer\); re-run "
                                          r"meshtron preprocess with the model's tokenizer, --tokenizer bytes, "):
        load(tmp_path / "bpe", vocab_size=300)
    with pytest.raises(ConfigError, match=r"^data\.blend: .*bytes was tokenized with bytes"):
        load(None, tokenizer=bpe.path, vocab_size=300, blend=[1, str(tmp_path / "bpe"), 1, str(tmp_path / "bytes")])
    assert load(tmp_path / "bpe", tokenizer=bpe.path, vocab_size=300).tokenizer.kind == "huggingface"
    meta_path(tmp_path / "bytes").unlink()  # as Megatron (or an older meshtron) writes it: accepted as before
    load(tmp_path / "bytes", tokenizer=bpe.path, vocab_size=300)


def test_a_retrained_tokenizer_of_the_same_size_is_another_tokenizer(tmp_path, bpe):
    """Its ids fit the same model and mean other text: only the record of the file tells them apart."""
    (tmp_path / "other.txt").write_text("\n".join(" ".join(reversed(WORDS[k:] + WORDS[:k])) for k in range(20)) * 5)
    other = train_bpe([tmp_path / "other.txt"], 300, tmp_path / "other.json").path
    preprocess(texts(tmp_path / "a.jsonl"), bpe.path, tmp_path / "bpe", progress=False)
    with pytest.raises(ConfigError, match=r"was tokenized with .*tokenizer\.json .* but this run's tokenizer is "
                                          r".*other\.json \(huggingface, 300 ids"):
        check_data_tokenizer(IndexedDataset(tmp_path / "bpe"), load_tokenizer(other), str(other), "data.path")


def test_a_fine_tune_names_the_checkpoints_tokenizer_as_the_fix(tmp_path, bpe):
    source = texts(tmp_path / "a.jsonl")
    imported = fake_checkpoint(tmp_path / "import", 300, bpe)
    carried = imported / "tokenizer.json"
    preprocess(source, "bytes", tmp_path / "bytes", progress=False)
    with pytest.raises(ConfigError, match=rf"; re-run meshtron preprocess with the model's tokenizer, --tokenizer "
                                          rf"{carried}, into .*bytes$"):
        load(tmp_path / "bytes", tokenizer=carried, vocab_size=300, init_from=imported)
    preprocess(source, carried, tmp_path / "bpe", progress=False)  # the right data, the wrong data.tokenizer
    with pytest.raises(ConfigError, match=rf"; set data\.tokenizer={carried} \(the tokenizer of train\.init_from's "
                                          r"model, which wrote the data\)$"):
        load(tmp_path / "bpe", vocab_size=300, init_from=imported)
    load(tmp_path / "bpe", tokenizer=carried, vocab_size=300, init_from=imported)


def test_trainer_passes_train_init_from_to_the_data_checks(tmp_path):
    """The start of a run (Trainer.from_config) checks the data against train.init_from's model."""
    from meshtron.train.loop import Trainer

    preprocess(texts(tmp_path / "a.jsonl", 40), "bytes", tmp_path / "data", progress=False)
    imported = fake_checkpoint(tmp_path / "import", 256)
    cfg = load_config(None, ["model.layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=16",
                             "model.vocab_size=300", f"data.path={tmp_path / 'data'}", f"train.init_from={imported}",
                             "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "train.steps=1"])
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: 300 is larger than the checkpoint's 256"):
        Trainer.from_config(cfg)


# -- D: model.vocab_size against a checkpoint's -----------------------------------------------------------------

def test_a_vocab_size_larger_than_the_checkpoints_is_refused(tmp_path, bpe):
    preprocess(texts(tmp_path / "a.jsonl"), "bytes", tmp_path / "bytes", progress=False)
    imported = fake_checkpoint(tmp_path / "import", 256)
    with pytest.raises(ConfigError, match=rf"^model\.vocab_size: 300 is larger than the checkpoint's 256 "
                                          rf"\(train\.init_from={imported}\): the extra rows would start at zero; set "
                                          r"model\.vocab_size=256 and re-run meshtron preprocess with its tokenizer "
                                          r"\(--tokenizer bytes\)$"):
        load(tmp_path / "bytes", vocab_size=300, init_from=imported)
    load(tmp_path / "bytes", vocab_size=256, init_from=imported)


def test_a_vocabulary_error_of_a_fine_tune_advises_its_tokenizer_not_a_larger_model(tmp_path, bpe):
    imported = fake_checkpoint(tmp_path / "import", 256)
    fix = (rf"; train\.init_from={imported} fixes the model's vocabulary \(its 256 ids\), so a larger "
           r"model\.vocab_size would only add untrained rows: re-run meshtron preprocess with the model's tokenizer "
           r"\(--tokenizer bytes\) and set data\.tokenizer=bytes$")
    preprocess(texts(tmp_path / "a.jsonl"), bpe.path, tmp_path / "bpe", progress=False)
    meta_path(tmp_path / "bpe").unlink()  # no record of its tokenizer: only its ids show it
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: .*bpe holds token id 2\d\d" + fix):
        load(tmp_path / "bpe", vocab_size=256, init_from=imported)
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: 256 does not cover the tokenizer's 300 ids \(.*\)" + fix):
        load(tmp_path / "bpe", tokenizer=bpe.path, vocab_size=256, init_from=imported)
    with pytest.raises(ConfigError, match=r"; set model\.vocab_size=\d+ or more \(the vocabulary of the tokenizer"):
        load(tmp_path / "bpe", vocab_size=256)  # a new model: growing it is the fix


# -- E: SFT lines without an answer, and --no-eod -------------------------------------------------------------

@pytest.mark.parametrize("line, message", [
    ({"prompt": "copy ab", "response": ""}, (r"'response' is empty, so there is no answer to learn; write the "
                                             "answer or drop the line")),
    ({"prompt": "copy ab", "response": "  "}, r"'response' is empty, .*"),
    ({"messages": [{"role": "user", "content": "copy ab"}, {"role": "assistant", "content": ""}]},
     r"the assistant message's content is empty, so there is no answer to learn; write the answer or drop the line"),
])
def test_an_sft_line_without_an_answer_is_one_line_naming_it(tmp_path, line, message):
    source = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "copy ab", "response": "ab"}, line])
    with pytest.raises(ConfigError, match=rf"^--input: .*bad\.jsonl:2: {message}$"):
        preprocess_sft(source, "bytes", tmp_path / "out", progress=False)
    assert not list(tmp_path.glob("out*"))


def test_an_empty_assistant_turn_beside_an_answered_one_is_accepted(tmp_path):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
             {"role": "user", "content": "copy ab"}, {"role": "assistant", "content": "ab"}]
    preprocess_sft(write_jsonl(tmp_path / "ok.jsonl", [{"messages": turns}]), "bytes", tmp_path / "sft", progress=False)
    assert IndexedDataset(tmp_path / "sft").num_documents == 1


def test_sft_without_end_markers(tmp_path):
    source = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "copy ab", "response": "ab"}])
    preprocess_sft(source, "bytes", tmp_path / "sft", append_eod=False, progress=False)
    ids, mask = IndexedDataset(tmp_path / "sft").document(0), IndexedDataset(mask_prefix(tmp_path / "sft")).document(0)
    assert bytes(ids.tolist()).decode() == "<|user|>\ncopy ab\n<|assistant|>\nab"
    assert bytes(ids[mask == 1].tolist()).decode() == "ab"
    assert json.loads(meta_path(tmp_path / "sft").read_text())["append_eod"] is False
    preprocess_sft(source, "bytes", tmp_path / "sft", progress=False)
    assert bytes(IndexedDataset(tmp_path / "sft").document(0).tolist()).decode().endswith("ab<|end|>")


def test_check_answers_reads_the_split_of_a_blend(tmp_path):
    preprocess_sft(long_prompts(tmp_path / "sft.jsonl", 4, 0), "bytes", tmp_path / "sft", progress=False)
    from meshtron.data.blend import BlendedSamples

    blend = BlendedSamples.from_blend([1, str(tmp_path / "sft")], seq_len=32, seed=0, num_samples=4,
                                      holdout_fraction=0.0)
    with pytest.raises(ConfigError, match=r"^data\.blend: every one of the 4 training examples"):
        check_answers(blend, seq_len=32, field="data.blend")
