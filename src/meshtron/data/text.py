"""Text -> byte tokens -> batches sharded over ``data``, deterministic and resumable.

The built-in corpus is the text of CPython 3.11.7's ``pydoc_data.topics`` (466,273 bytes of English
technical prose), shipped gzip-compressed in the package (``builtin_corpus.txt.gz``, under the PSF
license in ``builtin_corpus.NOTICE.txt``) rather than read from the running Python: the module's text
changes between CPython releases (3.12.1's is 6% longer), and the default run must train on the same
bytes on every supported Python. Any UTF-8 text file can replace it through ``data.path``. Tokens are
bytes (vocabulary 256) or, with ``data.tokenizer``, a tokenizer's ids (:mod:`meshtron.data.tokenizers`);
the text is split into its training part and held-out tail before tokenizing, so the held-out loss
per byte compares runs with different tokenizers. (A corpus too large to tokenize at every start
belongs in an indexed dataset: ``meshtron preprocess``.)

Batch ``i`` is a set of random windows whose start offsets depend only on ``(seed, i)``; the
stream's whole state is the index of the next batch (:attr:`BatchStream.position`), so saving
and resuming that integer reproduces the data order exactly. Each process builds only the rows
that its own devices hold (``jax.make_array_from_callback`` asks for those slices only).
"""

from __future__ import annotations

import gzip
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Self

import numpy as np

from meshtron.config import DataConfig
from meshtron.data.tokenizers import BYTE_VOCAB, BYTES, Tokenizer, check_vocab, load_tokenizer
from meshtron.errors import ConfigError

BUILTIN_SOURCE = "built-in (CPython 3.11.7 pydoc topics)"


@cache
def builtin_text() -> str:
    """The shipped corpus: CPython 3.11.7's pydoc topic texts in sorted-key order."""
    return gzip.decompress((files("meshtron") / "builtin_corpus.txt.gz").read_bytes()).decode("utf-8")


def load_text(cfg: DataConfig) -> str:
    if cfg.path is None:
        return builtin_text()
    path = Path(cfg.path)
    if path.is_dir():
        raise ConfigError(f"data.path: {str(path)!r} is a directory; give a UTF-8 text file in it")
    if not path.is_file():
        raise ConfigError(f"data.path: {str(path)!r} does not exist; give a UTF-8 text file or unset data.path")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"data.path: {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None


@dataclass(frozen=True)
class Corpus:
    """A text's tokens split into a training part and a held-out tail."""

    train: np.ndarray
    heldout: np.ndarray
    source: str
    tokenizer: Tokenizer
    heldout_bytes_per_token: float = 1.0  # UTF-8 bytes of the held-out text per held-out token
    vocab_size: int = BYTE_VOCAB

    @classmethod
    def from_config(cls, cfg: DataConfig, *, seq_len: int, batch_size: int, vocab_size: int,
                    tokenizer: Tokenizer | None = None) -> Corpus:
        tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
        if tokenizer.kind == BYTES and vocab_size < BYTE_VOCAB:
            raise ConfigError(
                f"model.vocab_size: byte-level tokens need at least {BYTE_VOCAB}, got {vocab_size}"
            )
        check_vocab(tokenizer, vocab_size)
        text = load_text(cfg)
        source = cfg.path or BUILTIN_SOURCE
        if tokenizer.kind == BYTES:
            tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            split = int(len(tokens) * (1 - cfg.holdout_fraction))
            corpus = cls(tokens[:split], tokens[split:], source, tokenizer)
        else:  # split the text, then tokenize each part: no token straddles the boundary
            cut = int(len(text) * (1 - cfg.holdout_fraction))
            dtype = np.uint16 if tokenizer.vocab_size <= 65_536 else np.int32
            train, heldout = (np.asarray(tokenizer.encode(part), dtype=dtype) for part in (text[:cut], text[cut:]))
            per_token = len(text[cut:].encode("utf-8")) / max(len(heldout), 1)
            corpus = cls(train, heldout, f"{source}, tokenizer {tokenizer.source}", tokenizer, per_token,
                         tokenizer.vocab_size)
        window = seq_len + 1
        need = batch_size * window
        if len(corpus.train) < need:
            raise ConfigError(
                f"data.path: the training split of {corpus.source} has {len(corpus.train)} tokens, fewer than "
                f"one batch ({batch_size} x {window} = {need}); use a longer text or lower train.batch_size / "
                "model.seq_len"
            )
        if len(corpus.heldout) < window:
            raise ConfigError(
                f"data.holdout_fraction: the held-out split has {len(corpus.heldout)} tokens, fewer than one "
                f"sequence ({window}); raise data.holdout_fraction or use a longer text"
            )
        return corpus

    def unigram_loss(self) -> float:
        """Cross-entropy (nats/token) of the held-out split under the training split's byte frequencies.

        The baseline a model must beat: anything that learns context scores below it.
        """
        counts = np.bincount(self.train, minlength=self.vocab_size).astype(np.float64) + 1.0
        log_probs = np.log(counts / counts.sum())
        return float(-log_probs[self.heldout].mean())

    def train_stream(self, *, batch_size: int, seq_len: int, seed: int, position: int = 0,
                     cursor: dict | None = None) -> BatchStream:
        del cursor  # the stream's whole state is the batch index
        return BatchStream(self.train, batch_size=batch_size, seq_len=seq_len, seed=seed, position=position)

    def heldout_stream(self, *, batch_size: int, seq_len: int, seed: int) -> BatchStream:
        return heldout_stream(self, batch_size=batch_size, seq_len=seq_len, seed=seed)


class Batches(ABC):
    """Batches ``[batch_size, window]`` addressed by index, whose whole state is :attr:`position` (the
    next batch): what the training loop saves and resumes. Subclasses say which rows batch ``i`` holds
    (:meth:`rows`); each process builds only the rows its devices hold."""

    def __init__(self, *, batch_size: int, window: int, position: int = 0, channels: tuple[int, ...] = ()):
        self.batch_size, self.window, self.position = batch_size, window, position
        self.channels = channels  # (3,): windows of packed documents, [batch, window, 3]

    @abstractmethod
    def rows(self, index: int, row_slice: slice) -> np.ndarray:
        """Rows ``row_slice`` of batch ``index``, ``[rows, window]`` tokens."""

    def global_batch(self, index: int) -> np.ndarray:
        return self.rows(index, slice(None))

    def batch(self, index: int, sharding):
        """Batch ``index`` as a global ``jax.Array`` laid out by ``sharding`` (local rows only)."""
        import jax

        shape = (self.batch_size, self.window, *self.channels)
        return jax.make_array_from_callback(shape, sharding, lambda idx: self.rows(index, idx[0]))

    def next(self, sharding):
        """The batch at ``position``, which then advances by one."""
        array = self.batch(self.position, sharding)
        self.position += 1
        return array

    def state(self) -> dict[str, int]:
        return {"position": self.position}

    def cursor(self) -> dict | None:
        """More state than the batch index, saved in the checkpoint beside it (None: none; a streamed
        source's read position, :mod:`meshtron.data.streaming`)."""
        return None

    def close(self) -> None:
        """Stop whatever prepares batches ahead (nothing here)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BatchStream(Batches):
    """Deterministic batches of ``[batch_size, seq_len + 1]`` random windows from one token array."""

    def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int, position: int = 0):
        super().__init__(batch_size=batch_size, window=seq_len + 1, position=position)
        self.tokens = tokens
        self.seed = seed

    def starts(self, index: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, index))
        return rng.integers(0, len(self.tokens) - self.window + 1, size=self.batch_size)

    def rows(self, index: int, row_slice: slice) -> np.ndarray:
        """Rows ``row_slice`` of batch ``index`` as int32 (only those rows are materialised)."""
        starts = self.starts(index)[row_slice]
        return np.stack([self.tokens[s : s + self.window] for s in starts]).astype(np.int32)


def heldout_stream(corpus: Corpus, *, batch_size: int, seq_len: int, seed: int) -> BatchStream:
    """The fixed held-out evaluation set: batch ``i`` is the same at every evaluation."""
    return BatchStream(corpus.heldout, batch_size=batch_size, seq_len=seq_len, seed=seed + 1_000_003)
