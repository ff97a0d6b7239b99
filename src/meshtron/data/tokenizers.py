"""Tokenizers, offline and from files: bytes (the default), a Hugging Face ``tokenizer.json``, or a
SentencePiece ``.model``; and training a byte-level BPE with the ``tokenizers`` library.

Why one small interface: the data pipeline (:mod:`meshtron.data.preprocess`, the text corpus),
``generate`` and the checkpoint only need ``encode``, ``decode``, the vocabulary size and the
end-of-document id, whatever library is behind them. A tokenizer travels with the checkpoint: its
file is copied into the checkpoint directory (:func:`save_tokenizer`) and :func:`checkpoint_tokenizer`
reads it back, so a checkpoint decodes with the tokenizer that trained it wherever it is copied.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from meshtron.errors import ConfigError

BYTES = "bytes"
BYTE_VOCAB = 256
# The names under which a checkpoint directory keeps its tokenizer (one of them, or neither: bytes).
CHECKPOINT_FILES = {"huggingface": "tokenizer.json", "sentencepiece": "tokenizer.model"}
# End-of-document tokens, in order of preference, as the common tokenizer families spell them.
_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class Tokenizer(Protocol):
    """What meshtron needs of a tokenizer."""

    kind: str  # bytes | huggingface | sentencepiece
    source: str  # where it came from, for messages and the run summary
    vocab_size: int  # ids are 0..vocab_size-1; model.vocab_size must be at least this
    eod: int | None  # the end-of-document id appended after each document, None: none (bytes)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes: 256 ids and no end-of-document token (there is no id left for one). Decoding
    replaces byte sequences that are not UTF-8 (a sampled model can produce them)."""

    kind, source, vocab_size, eod = BYTES, BYTES, BYTE_VOCAB, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:  # the fast path of the text corpus
        return text.encode("utf-8")

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` read by Hugging Face's ``tokenizers`` (no special tokens are added on
    encoding: documents are separated by the end-of-document id instead)."""

    kind = "huggingface"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 -- the library raises a bare Exception on a malformed file
            raise ConfigError(f"data.tokenizer: {str(path)!r} is not a Hugging Face tokenizer.json ({err})") from None
        self.path, self.source = path, str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = next((i for i in map(self._tok.token_to_id, _EOD_NAMES) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` (Llama 2, T5, ...); its ``eos`` id ends a document."""

    kind = "sentencepiece"

    def __init__(self, path: Path):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as err:
            raise ConfigError(f"data.tokenizer: {str(path)!r} is not a SentencePiece model ({err})") from None
        self.path, self.source = path, str(path)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def load_tokenizer(spec: str | Path | None) -> Tokenizer:
    """``bytes`` (or None), a ``tokenizer.json`` or a SentencePiece ``.model``, by what the file is."""
    if spec is None or str(spec) == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"data.tokenizer: {str(spec)!r} is not a file; give 'bytes', a Hugging Face "
                          "tokenizer.json or a SentencePiece .model (train one: meshtron tokenizer train)")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.suffix == ".json":
        return HuggingFaceTokenizer(path)
    raise ConfigError(f"data.tokenizer: {str(spec)!r}: expected a Hugging Face tokenizer.json (.json) or a "
                      "SentencePiece model (.model)")


def check_vocab(tokenizer: Tokenizer, vocab_size: int, fix: str | None = None) -> None:
    """``model.vocab_size`` must give every id of the tokenizer an embedding row. ``fix``: the advice
    when a larger ``model.vocab_size`` is not it (a model started from a checkpoint has its
    vocabulary already); by default, to set one."""
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size: {vocab_size} does not cover the tokenizer's {tokenizer.vocab_size} ids "
                          f"({tokenizer.source}); {fix or f'set model.vocab_size={tokenizer.vocab_size} or more'}")


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_record(tokenizer: Tokenizer) -> dict:
    """What identifies a tokenizer in a dataset's metadata (:func:`meshtron.data.indexed.read_meta`):
    for bytes its kind alone; else its kind, file (absolute), vocabulary size, end-of-document id and
    the SHA-256 of the file's bytes -- two tokenizers whose ids merely fit the same model differ there."""
    if tokenizer.kind == BYTES:
        return {"kind": BYTES}
    path = getattr(tokenizer, "path", None)
    has_file = path is not None and Path(path).is_file()
    record = {"kind": tokenizer.kind, "source": str(Path(path).absolute()) if has_file else str(tokenizer.source),
              "vocab_size": int(tokenizer.vocab_size), "eod": tokenizer.eod}
    if has_file:
        record["sha256"] = file_sha256(path)
    return record


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two :func:`tokenizer_record` s are one tokenizer: the same kind and file bytes (the same
    size and end id when a record has no file hash)."""
    if a.get("kind") != b.get("kind"):
        return False
    if a.get("kind") == BYTES:
        return True
    if a.get("sha256") and b.get("sha256"):
        return a["sha256"] == b["sha256"]
    return (a.get("vocab_size"), a.get("eod")) == (b.get("vocab_size"), b.get("eod"))


def describe_tokenizer(record: dict) -> str:
    """A :func:`tokenizer_record` in a few words, for messages."""
    if record.get("kind") == BYTES:
        return BYTES
    sha = f", sha256 {record['sha256'][:12]}" if record.get("sha256") else ""
    return f"{record.get('source')} ({record.get('kind')}, {record.get('vocab_size')} ids{sha})"


def carried_tokenizer(directory: str | Path) -> str:
    """The ``--tokenizer`` / ``data.tokenizer`` value of the tokenizer a checkpoint directory carries:
    its file, or ``bytes`` when it carries none (:func:`save_tokenizer`)."""
    for name in CHECKPOINT_FILES.values():
        path = Path(directory) / name
        if path.is_file():
            return str(path)
    return BYTES


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> Path | None:
    """Copy the tokenizer's file into ``directory`` (a checkpoint directory) under its
    :data:`CHECKPOINT_FILES` name; nothing for bytes. Returns the copy."""
    if tokenizer.kind == BYTES:
        return None
    target = Path(directory) / CHECKPOINT_FILES[tokenizer.kind]
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists() or target.read_bytes() != tokenizer.path.read_bytes():
        tmp = target.with_suffix(target.suffix + ".tmp")
        shutil.copyfile(tokenizer.path, tmp)
        tmp.replace(target)  # atomic: a reader never sees half a file
    return target


def checkpoint_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer a checkpoint directory carries (bytes when it carries none)."""
    for name in CHECKPOINT_FILES.values():
        path = Path(directory) / name
        if path.is_file():
            return load_tokenizer(path)
    return ByteTokenizer()


def train_bpe(files: Iterable[str | Path], vocab_size: int, output: str | Path, *,
              min_frequency: int = 2) -> HuggingFaceTokenizer:
    """Train a byte-level BPE (GPT-2's kind: every byte is a base token, so any text encodes) on
    ``files`` with ``<|endoftext|>`` as id 0, and save it as a ``tokenizer.json`` at ``output``."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    paths = [str(f) for f in files]
    for f in paths:
        if not Path(f).is_file():
            raise ConfigError(f"--input: {f!r} is not a file")
    if vocab_size < BYTE_VOCAB + 1:
        raise ConfigError(f"--vocab-size: a byte-level BPE needs at least {BYTE_VOCAB + 1} ids (256 bytes and "
                          f"<|endoftext|>), got {vocab_size}")
    tok = _Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(paths, trainer)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(output))
    return HuggingFaceTokenizer(output)
