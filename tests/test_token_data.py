"""Training on Megatron-LM indexed datasets and blends of them: ``meshtron preprocess`` output as
``data.path``, a run killed mid-epoch resumes with the same batches (bitwise losses), a blend
trains with Megatron's proportions, and bad data configs are one line."""

import json
import shutil

import numpy as np
import pytest
from test_checkpoint import MODEL, killed_at, mesh, without_checkpoints
from test_cli import meshtron

from meshtron.config import ConfigError, load_config
from meshtron.data import builtin_text
from meshtron.data.preprocess import preprocess
from meshtron.data.sources import TokenDatasets
from meshtron.data.tokenizers import load_tokenizer, train_bpe
from meshtron.train.loop import Trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The built-in corpus as ~2 KB documents, preprocessed as bytes and with a 512-id BPE."""
    root = tmp_path_factory.mktemp("indexed")
    paragraphs = builtin_text().split("\n\n")
    docs = ["\n\n".join(paragraphs[i:i + 12]) for i in range(0, len(paragraphs), 12)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "train.txt").write_text("\n\n".join(docs[: int(0.9 * len(docs))]))
    train_bpe([root / "train.txt"], 512, root / "tokenizer.json")
    preprocess([str(root / "docs.jsonl")], "bytes", str(root / "bytes"), progress=False)
    preprocess([str(root / "docs.jsonl")], str(root / "tokenizer.json"), str(root / "bpe"), workers=2, progress=False)
    return root, docs


def trainer(*overrides) -> Trainer:
    return Trainer.from_config(load_config(None, [*MODEL, *overrides]))


def test_preprocessed_bpe_dataset_holds_the_tokenizers_ids(datasets):
    root, docs = datasets
    tok = load_tokenizer(root / "tokenizer.json")
    data = trainer(*mesh(8, 1, 1), f"data.path={root / 'bpe'}", f"data.tokenizer={root / 'tokenizer.json'}",
                   "model.vocab_size=512").corpus
    assert isinstance(data, TokenDatasets) and data.source == f"indexed {root / 'bpe'}"
    window = data.train.sample(0)
    assert window.shape == (17,) and window.max() < 512
    stream = np.concatenate([np.asarray(tok.encode(d) + [tok.eod]) for d in docs])  # every document + <|endoftext|>
    starts = np.flatnonzero(stream[:-16] == window[0])
    assert any(np.array_equal(stream[s:s + 17], window) for s in starts)  # a window of the document stream
    assert 2.0 < data.heldout_bytes_per_token < 4.0


@pytest.mark.parametrize("layout", [mesh(2, 2, 2, "interleaved", 2, 2)])
def test_a_run_killed_mid_epoch_resumes_with_the_same_batches(datasets, tmp_path, layout):
    root, _ = datasets
    t = trainer(*layout, f"data.path={root / 'bytes'}", "train.steps=6", f"checkpoint.dir={tmp_path}",
                "checkpoint.every=3")
    assert len(t.corpus.train) == 6 * 16  # samples, built for the run; an epoch is far longer
    straight = without_checkpoints(t).run()
    killed_at(t, 4)  # one step after the checkpoint at 3: that step is redone from the saved position
    resumed = t.run()
    assert resumed.first_step == 4 and resumed.losses == straight.losses[3:]  # bitwise
    assert np.isfinite(resumed.heldout_loss) and resumed.heldout_loss == straight.heldout_loss


def test_a_blend_trains_with_megatrons_proportions(datasets, tmp_path):
    root, _ = datasets
    other = tmp_path / "shifted"
    from meshtron.data.indexed import IndexedDataset, write_dataset

    source = IndexedDataset(root / "bytes")  # the same documents, shifted ids: a second, distinguishable corpus
    write_dataset(other, [source.document(i) + 1 for i in range(source.num_documents)], np.uint16)
    t = trainer(*mesh(8, 1, 1), f"data.blend=[0.25,{root / 'bytes'},0.75,{other}]", "model.vocab_size=384",
                "train.steps=4", "train.batch_size=40")
    assert t.corpus.source == f"blend 0.25 x {root / 'bytes'}, 0.75 x {other}"
    assert list(t.corpus.train.counts) == [40, 120]  # of 160 samples
    result = t.run()
    assert len(result.losses) == 4 and all(np.isfinite(result.losses))


def test_bad_data_configs_are_one_line(datasets, tmp_path):
    root, _ = datasets
    with pytest.raises(ConfigError, match="data.blend: give either data.path or data.blend, not both"):
        load_config(None, [f"data.path={root / 'bytes'}", f"data.blend=[1,{root / 'bytes'}]"])
    with pytest.raises(ConfigError, match=r"data.path: .*bpe was tokenized with .*tokenizer.json \(huggingface, 512 ids, "
                                          r"sha256 \w+\) but this run's tokenizer is bytes \(data.tokenizer\)"):
        trainer(*mesh(8, 1, 1), f"data.path={root / 'bpe'}", "model.vocab_size=256")
    for suffix in (".bin", ".idx"):  # the same tokens without meshtron's record of the tokenizer (Megatron's tools)
        shutil.copyfile(root / f"bpe{suffix}", tmp_path / f"megatron{suffix}")
    with pytest.raises(ConfigError, match=r"model.vocab_size: .*megatron holds token id 5\d\d; set model.vocab_size="):
        trainer(*mesh(8, 1, 1), f"data.path={tmp_path / 'megatron'}", "model.vocab_size=256")
    with pytest.raises(ConfigError, match="model.vocab_size: 256 does not cover the tokenizer's 512 ids"):
        trainer(*mesh(8, 1, 1), f"data.path={root / 'bpe'}", f"data.tokenizer={root / 'tokenizer.json'}")
    run = meshtron("train", "--config", "mesh_configs/cpu8.yaml", f"data.blend=[0.5,{root / 'bytes'},0.5]")
    assert run.returncode == 2 and "data.blend" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    run = meshtron("preprocess", "--input", str(tmp_path / "none*.jsonl"), "--tokenizer", "bytes",
                   "--output", str(tmp_path / "x"))
    assert run.returncode == 2 and "--input" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
