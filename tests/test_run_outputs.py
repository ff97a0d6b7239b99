"""Tokenizers and what a run leaves behind: a BPE trained by ``meshtron tokenizer train`` used for
training and carried by the checkpoint into ``generate``; held-out loss (per token and per byte) in
the JSONL; TensorBoard event files read back by TensorBoard's own reader; a profiler trace; plain
progress lines in a log file; ``meshtron plot``."""

import json

import pytest
from test_cli import SMALL, meshtron

from meshtron.config import ConfigError, DataConfig, MeshConfig
from meshtron.data import Corpus, builtin_text
from meshtron.data.tokenizers import (
    ByteTokenizer,
    check_vocab,
    checkpoint_tokenizer,
    load_tokenizer,
    train_bpe,
)
from meshtron.generate import sample
from meshtron.pretrained import load_pretrained

pytestmark = pytest.mark.slow

QUICK = [*SMALL, "parallel.data=4", "parallel.pipe=1", "parallel.chunks=1", "parallel.microbatches=2"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(builtin_text()[:120_000], encoding="utf-8")
    return path


def test_bpe_trains_round_trips_and_must_fit_the_model(corpus_file, tmp_path):
    tok = train_bpe([corpus_file], 400, tmp_path / "tokenizer.json")
    assert tok.vocab_size == 400 and tok.eod == 0  # <|endoftext|> first
    text = "The assert statement: «ünïcode» too\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(builtin_text()[:10_000])) < 0.6 * 10_000  # 143 merges learned: fewer tokens than bytes
    with pytest.raises(ConfigError, match=r"model.vocab_size: 300 does not cover the tokenizer's 400 ids .*"
                                          r"set model.vocab_size=400 or more"):
        check_vocab(tok, 300)
    corpus = Corpus.from_config(DataConfig(path=str(corpus_file), tokenizer=str(tmp_path / "tokenizer.json")),
                                seq_len=32, batch_size=8, vocab_size=512)
    assert corpus.heldout_bytes_per_token > 1.5 and corpus.train.max() < 400
    assert corpus.tokenizer.decode(corpus.heldout[:50].tolist()) == builtin_text()[108_000:][:len(
        corpus.tokenizer.decode(corpus.heldout[:50].tolist()))]  # the held-out tail, tokenized on its own
    with pytest.raises(ConfigError, match="data.tokenizer: .*nope.json' is not a file"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    assert isinstance(checkpoint_tokenizer(tmp_path / "empty"), ByteTokenizer)


def test_sentencepiece_model_loads_and_round_trips(corpus_file, tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    sentencepiece.SentencePieceTrainer.train(input=str(corpus_file), model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                             minloglevel=2)
    tok = load_tokenizer(tmp_path / "sp.model")
    assert tok.kind == "sentencepiece" and tok.vocab_size == 300 and tok.eod == 2  # SentencePiece's </s>
    assert tok.decode(tok.encode("The assert statement")) == "The assert statement"


def test_a_bpe_run_logs_everywhere_and_its_checkpoint_decodes_with_its_tokenizer(corpus_file, tmp_path):
    tok_path = tmp_path / "tok.json"
    made = meshtron("tokenizer", "train", "--input", str(corpus_file), "--vocab-size", "384", "--output", str(tok_path))
    assert made.returncode == 0, made.stderr
    assert "byte-level BPE, 384 ids, end of document <|endoftext|> = 0" in made.stdout
    metrics, board, profile, ckpt = (tmp_path / n for n in ("m.jsonl", "tb", "prof", "ckpt"))
    run = meshtron(
        "train", "--config", "mesh_configs/cpu8.yaml", *QUICK, f"data.path={corpus_file}", f"data.tokenizer={tok_path}",
        "model.vocab_size=384", "train.steps=6", "train.log_every=2", "train.eval_every=3", "train.eval_batches=2",
        "train.profile_steps=4:5", f"train.profile_dir={profile}", "train.peak_flops=1e11", f"checkpoint.dir={ckpt}",
        "--metrics", str(metrics), "--tensorboard", str(board),
    )
    assert run.returncode == 0, run.stderr
    # held-out loss in the JSONL, per token and per byte of text; evaluation steps are always logged
    start, *records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert start == {"step": 0, "event": "start", "weights": "a new model from seed 0"}  # where the weights came from
    assert [r["step"] for r in records] == [2, 3, 4, 6]
    held = {r["step"]: r for r in records if "heldout_loss" in r}
    assert sorted(held) == [3, 6]
    per_byte = held[6]["heldout_loss"] / held[6]["heldout_loss_per_byte"]
    assert 1.5 < per_byte < 5  # bytes of text per BPE token
    assert f"{held[6]['heldout_loss_per_byte']:.4f} nats/byte of text" in run.stdout
    assert all(0 < r["mfu"] == pytest.approx(r["model_flops_per_s"] / (1e11 * 8)) for r in records)
    # stderr is not a terminal: plain progress lines instead of a redrawn bar
    assert "step 2/6  loss " in run.stderr and "step 6/6  loss " in run.stderr
    # TensorBoard's own reader sees every figure
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/heldout_loss", "eval/heldout_nats_per_byte", "train/learning_rate", "train/grad_norm",
            "perf/tokens_per_s", "perf/step_seconds", "perf/model_flops_per_s", "perf/model_flops_utilisation",
            "comm/bytes_over_data_per_step"} <= tags
    assert [e.step for e in events.Scalars("eval/heldout_loss")] == [3, 6]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in records])
    weights = events.Tensors("run/weights/text_summary")
    assert [e.step for e in weights] == [0] and weights[0].tensor_proto.string_val == [b"a new model from seed 0"]
    # the profiler trace of steps 4..5
    assert list(profile.glob("plugins/profile/*/*.xplane.pb")) and list(profile.glob("plugins/profile/*/*.trace.json.gz"))
    # the checkpoint carries the tokenizer: generate encodes the prompt and decodes with it
    assert (ckpt / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    sampled = meshtron("generate", "--checkpoint", str(ckpt), "--prompt", "The assert", "--max-tokens", "8")
    assert sampled.returncode == 0, sampled.stderr
    model = load_pretrained(ckpt, MeshConfig(data=8, pipe=1, tensor=1))
    assert model.tokenizer.kind == "huggingface"
    here = sample(model.model_def, model.params, model.mesh, "The assert", max_new_tokens=8, tokenizer=model.tokenizer)
    assert list(here.prompt_tokens) == load_tokenizer(tok_path).encode("The assert")
    assert sampled.stdout == here.text + "\n" and here.text == load_tokenizer(tok_path).decode(here.tokens)
    # meshtron plot draws the run's curves
    drawn = meshtron("plot", str(metrics), "--output", str(tmp_path / "loss.png"), "--per-byte")
    assert drawn.returncode == 0, drawn.stderr
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokenizer_and_logging_input_errors_are_one_line(corpus_file, tmp_path):
    cases = [
        (["train", "--config", "mesh_configs/cpu8.yaml", *QUICK, "data.tokenizer=missing.json"],
         "data.tokenizer: 'missing.json' is not a file"),
        (["train", "--config", "mesh_configs/cpu8.yaml", *QUICK, "train.profile_steps=5"],
         "train.profile_steps: expected FIRST:LAST step numbers such as 5:7, got '5'"),
        (["tokenizer", "train", "--input", str(corpus_file), "--vocab-size", "100", "--output", str(tmp_path / "t.json")],
         "--vocab-size: a byte-level BPE needs at least 257 ids"),
        (["plot", str(tmp_path / "none.jsonl")], "no such metrics file"),
    ]
    for args, message in cases:
        run = meshtron(*args)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
        assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
