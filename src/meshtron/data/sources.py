"""The training data a config names -- a text (:class:`~meshtron.data.text.Corpus`), one indexed
token dataset, or a blend of them -- behind one interface the training loop uses.

Why one interface: the loop needs batches laid out over ``data`` that resume from an integer
position, a fixed held-out set, a unigram baseline and the bytes of text per held-out token (so a
run with a BPE tokenizer and a byte-level run compare in nats per byte). A text corpus draws
random windows from one token array; an indexed dataset serves Megatron's pre-built sample order
(:mod:`meshtron.data.samples`, :mod:`meshtron.data.blend`), reading only the rows a process holds
from a memory map.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from meshtron.checkpoint_dirs import checkpoint_location, read_step_meta, step_directories
from meshtron.config import DataConfig, indexed_prefix
from meshtron.data.preference import PreferencePairs
from meshtron.data.text import Batches, Corpus
from meshtron.data.tokenizers import (
    BYTES,
    Tokenizer,
    carried_tokenizer,
    check_vocab,
    describe_tokenizer,
    load_tokenizer,
    same_tokenizer,
    tokenizer_record,
)
from meshtron.errors import ConfigError

_UNIGRAM_SAMPLE_TOKENS = 1 << 20  # training tokens the unigram baseline of an indexed dataset counts


class Samples(Protocol):
    """A deterministic sequence of ``seq_len + 1``-token samples."""

    def __len__(self) -> int: ...

    def sample(self, index: int) -> np.ndarray: ...


class SampleStream(Batches):
    """Batches of consecutive samples: batch ``i`` is samples ``i·B .. i·B + B - 1`` (modulo the
    sequence's length), so the stream's whole state is its position, as for
    :class:`~meshtron.data.text.BatchStream`."""

    def __init__(self, samples: Samples, *, batch_size: int, position: int = 0):
        first = samples.sample(0)
        super().__init__(batch_size=batch_size, window=len(first), position=position, channels=first.shape[1:])
        self.samples = samples

    def rows(self, index: int, row_slice: slice) -> np.ndarray:
        first = index * self.batch_size
        rows = range(self.batch_size)[row_slice]
        return np.stack([self.samples.sample((first + r) % len(self.samples)) for r in rows]).astype(np.int32)


class PairStream(SampleStream):
    """Batches of ``pairs`` preference pairs as ``[2·pairs, seq_len + 1, 3]``: pair ``k``'s chosen row at
    ``2k``, its rejected one at ``2k + 1``, so that any even split of the rows (data shards, microbatches)
    keeps every pair whole (:mod:`meshtron.data.preference`)."""

    def __init__(self, samples: Samples, *, pairs: int, position: int = 0):
        first = samples.sample(0)
        Batches.__init__(self, batch_size=2 * pairs, window=first.shape[1], position=position,
                         channels=first.shape[2:])
        self.samples, self.pairs = samples, pairs

    def rows(self, index: int, row_slice: slice) -> np.ndarray:
        rows = range(self.batch_size)[row_slice]
        first = index * self.pairs
        pairs = {p: self.samples.sample((first + p) % len(self.samples)) for p in sorted({r // 2 for r in rows})}
        return np.stack([pairs[r // 2][r % 2] for r in rows]).astype(np.int32)


def _stream(samples: Samples, batch_size: int, position: int = 0) -> SampleStream:
    if isinstance(samples, PreferencePairs):
        return PairStream(samples, pairs=batch_size, position=position)
    return SampleStream(samples, batch_size=batch_size, position=position)


@dataclass
class TokenDatasets:
    """One indexed dataset or a blend of several: training and held-out samples."""

    train: Samples
    heldout: Samples
    source: str
    tokenizer: Tokenizer  # what the tokens decode with (data.tokenizer: the one that wrote them)
    vocab_size: int
    heldout_bytes_per_token: float = float("nan")
    _unigram: float | None = field(default=None, repr=False)

    def train_stream(self, *, batch_size: int, seq_len: int, seed: int, position: int = 0,
                     cursor: dict[str, Any] | None = None) -> SampleStream:
        del seq_len, seed, cursor  # fixed when the sample order was built; the position is the batch index
        return _stream(self.train, batch_size, position)

    def heldout_stream(self, *, batch_size: int, seq_len: int, seed: int) -> SampleStream:
        del seq_len, seed
        return _stream(self.heldout, batch_size)

    @property
    def preference(self) -> bool:
        """Whether the samples are preference pairs (``batch_size`` counts pairs, two rows each)."""
        return isinstance(self.train, PreferencePairs)

    def unigram_loss(self) -> float:
        """Held-out cross-entropy under the unigram frequencies of the first training samples (about
        a million tokens: counting a whole corpus would read all of it)."""
        if self._unigram is None:
            window = len(self.train.sample(0))
            n = min(len(self.train), max(1, _UNIGRAM_SAMPLE_TOKENS // window))
            counts = np.ones(self.vocab_size, np.float64)
            for i in range(n):
                counts += np.bincount(tokens_of(self.train.sample(i)), minlength=self.vocab_size)[: self.vocab_size]
            log_probs = np.log(counts / counts.sum())
            held = np.concatenate([tokens_of(self.heldout.sample(i)) for i in range(min(len(self.heldout), 256))])
            self._unigram = float(-log_probs[np.minimum(held, self.vocab_size - 1)].mean())
        return self._unigram


def load_training_data(cfg: DataConfig, *, seq_len: int, batch_size: int, vocab_size: int, seed: int,
                       samples: int, eval_samples: int, init_from: str | None = None,
                       config_vocab_size: int | None = None) -> Corpus | TokenDatasets:
    """What ``data`` names: a text (tokenized by ``data.tokenizer``), an indexed dataset prefix, or
    ``data.blend``. ``samples``: training samples the run draws (``steps x batch``); an indexed
    dataset's sample order is built for that many (epochs repeat as needed).

    ``init_from``: ``train.init_from``, whose checkpoint fixes the model's vocabulary: a
    ``model.vocab_size`` (``config_vocab_size``, the run's config's; default ``vocab_size``, the
    model's) larger than the one its config records is refused (the extra rows would start at zero),
    and the advice of a vocabulary error is then to re-tokenize the data with the checkpoint's
    tokenizer, not to grow the model.
    An indexed dataset whose metadata (``PREFIX.meta.json``) names another tokenizer than
    ``data.tokenizer`` is refused; one without (Megatron's, older meshtron's) is read as before."""
    origin = ModelOrigin.of(init_from)
    if origin is not None:
        origin.check_vocab_size(vocab_size if config_vocab_size is None else config_vocab_size)
    if cfg.source != "indexed":
        from meshtron.data.streaming import load_streamed

        tokenizer = load_tokenizer(cfg.tokenizer)
        check_vocab(tokenizer, vocab_size, origin.vocab_fix() if origin is not None else None)
        return load_streamed(cfg, seq_len=seq_len, vocab_size=vocab_size, seed=seed, eval_samples=eval_samples,
                             tokenizer=tokenizer, documents=cfg.reset_per_document)
    if cfg.blend is None and (cfg.path is None or indexed_prefix(cfg.path) is None):
        if cfg.reset_per_document:
            raise ConfigError(f"data.reset_per_document: {cfg.path or 'the built-in corpus'} is one text, not "
                              "documents; preprocess documents into an indexed dataset (meshtron preprocess) and "
                              "train on that, or set data.reset_per_document=false")
        tokenizer = None
        if origin is not None:
            tokenizer = load_tokenizer(cfg.tokenizer)
            check_vocab(tokenizer, vocab_size, origin.vocab_fix())
        return Corpus.from_config(cfg, seq_len=seq_len, batch_size=batch_size, vocab_size=vocab_size,
                                  tokenizer=tokenizer)
    from meshtron.data.blend import Blend, BlendedSamples, parse_blend, split_windows
    from meshtron.data.indexed import IndexedDataset
    from meshtron.data.sft import check_answers

    tokenizer = load_tokenizer(cfg.tokenizer)
    check_vocab(tokenizer, vocab_size, origin.vocab_fix() if origin is not None else None)
    field_name = "data.blend" if cfg.blend is not None else "data.path"
    if cfg.blend is not None:
        blend = parse_blend(list(cfg.blend))
        prefixes = [indexed_prefix(p) or p for p in blend.prefixes]
        blend = Blend(blend.weights, prefixes)
    else:
        blend = Blend([1.0], [indexed_prefix(cfg.path)])
    for prefix in blend.prefixes:
        dataset = IndexedDataset(prefix)
        check_data_tokenizer(dataset, tokenizer, cfg.tokenizer, field_name, origin)
        high = _max_token(dataset)
        if high >= vocab_size:
            fix = (origin.vocab_fix() if origin is not None else
                   f"set model.vocab_size={high + 1} or more (the vocabulary of the tokenizer that wrote it)")
            raise ConfigError(f"model.vocab_size: {prefix} holds token id {high}; {fix}")
    documents = packs_documents(cfg)
    splits = {}
    for split, count in (("train", samples), ("heldout", eval_samples)):
        if len(blend.prefixes) == 1:
            splits[split] = split_windows(blend.prefixes[0], seq_len=seq_len, seed=seed, split=split,
                                          holdout_fraction=cfg.holdout_fraction, num_samples=count,
                                          documents=documents, pairs_per_window=cfg.pairs_per_window)
        else:  # each dataset sized to its share of the samples
            splits[split] = BlendedSamples.from_blend(blend, seq_len=seq_len, seed=seed, num_samples=count,
                                                      split=split, holdout_fraction=cfg.holdout_fraction,
                                                      documents=documents)
    pairs = [isinstance(w, PreferencePairs) for w in splits.values()]
    if any(pairs) and len(blend.prefixes) > 1:
        raise ConfigError("data.blend: holds preference pairs (meshtron preprocess --preference), which train alone; "
                          "give one such dataset as data.path")
    for split, windows in splits.items():
        check_answers(windows, seq_len=seq_len, field=field_name, split=split)
        if isinstance(windows, PreferencePairs):
            windows.check(field_name)
    source = (f"indexed {blend.prefixes[0]}" if len(blend.prefixes) == 1 else
              "blend " + ", ".join(f"{w:.3g} x {p}" for w, p in zip(blend.weights, blend.prefixes)))
    train_samples, heldout_samples = splits["train"], splits["heldout"]
    data = TokenDatasets(train_samples, heldout_samples, source, tokenizer, vocab_size)
    data.heldout_bytes_per_token = _bytes_per_token(data, eval_samples)
    return data


@dataclass(frozen=True)
class ModelOrigin:
    """The checkpoint ``train.init_from`` names, as far as the data cares: its model's real vocabulary
    (``model.vocab_size`` of the config it records; None when unreadable) and the tokenizer it
    carries (a file's path, or ``bytes``), which the data must be tokenized with."""

    init_from: str
    vocab_size: int | None
    tokenizer: str

    @classmethod
    def of(cls, init_from: str | None) -> ModelOrigin | None:
        if init_from is None:
            return None
        directory, step = checkpoint_location(init_from)
        steps = [step] if step is not None else list(reversed(step_directories(directory)))
        vocab = None
        for candidate in steps:  # the newest step whose meta record reads (a damaged one is skipped)
            config = (read_step_meta(directory, candidate) or {}).get("config")
            if isinstance(config, dict):
                vocab = (config.get("model") or {}).get("vocab_size")
                break
        return cls(str(init_from), vocab if isinstance(vocab, int) else None, carried_tokenizer(directory))

    def check_vocab_size(self, vocab_size: int) -> None:
        """Refuse a ``model.vocab_size`` above the checkpoint's: restoring would zero-pad the embedding
        and output rows (the padding to a multiple of 128 x tensor is resizable, so it is not refused
        there), and no tokenizer of the model has ids for them."""
        if self.vocab_size is not None and vocab_size > self.vocab_size:
            raise ConfigError(f"model.vocab_size: {vocab_size} is larger than the checkpoint's {self.vocab_size} "
                              f"(train.init_from={self.init_from}): the extra rows would start at zero; set "
                              f"model.vocab_size={self.vocab_size} and re-run meshtron preprocess with its tokenizer "
                              f"(--tokenizer {self.tokenizer})")

    def vocab_fix(self) -> str:
        """The advice of a vocabulary error on a run from this checkpoint."""
        size = f"its {self.vocab_size} ids" if self.vocab_size is not None else "its vocabulary"
        return (f"train.init_from={self.init_from} fixes the model's vocabulary ({size}), so a larger "
                f"model.vocab_size would only add untrained rows: re-run meshtron preprocess with the model's tokenizer "
                f"(--tokenizer {self.tokenizer}) and set data.tokenizer={self.tokenizer}")


def check_data_tokenizer(dataset: Any, tokenizer: Tokenizer, spec: str, field_name: str,
                         origin: ModelOrigin | None = None) -> None:
    """Refuse an indexed dataset whose metadata records another tokenizer than the run's (``spec``:
    ``data.tokenizer``): its ids would fit the model and mean other text. A dataset without
    metadata passes. The advice: re-tokenize with the model's tokenizer (``train.init_from``'s, else
    ``data.tokenizer``) -- or, when the data already has the model's tokenizer, point
    ``data.tokenizer`` at it."""
    from meshtron.data.indexed import read_meta

    meta = read_meta(dataset)
    recorded = (meta or {}).get("tokenizer")
    if not isinstance(recorded, dict):
        return
    own = tokenizer_record(tokenizer)
    if same_tokenizer(recorded, own):
        return
    written = recorded.get("source", BYTES) if recorded.get("kind") != BYTES else BYTES
    model = origin.tokenizer if origin is not None else spec
    if origin is not None and same_tokenizer(recorded, tokenizer_record(load_tokenizer(model))):
        fix = f"set data.tokenizer={model} (the tokenizer of train.init_from's model, which wrote the data)"
    else:
        fix = f"re-run meshtron preprocess with the model's tokenizer, --tokenizer {model}, into {dataset.prefix}"
        if origin is None:
            fix += f", or set data.tokenizer={written} if that is the model's"
    raise ConfigError(f"{field_name}: {dataset.prefix} was tokenized with {describe_tokenizer(recorded)} but this "
                      f"run's tokenizer is {describe_tokenizer(own)} (data.tokenizer); {fix}")


def packs_documents(cfg: DataConfig) -> bool:
    """Whether ``data`` trains on windows of packed documents (``[batch, seq + 1, 3]`` batches):
    ``data.reset_per_document``, or supervised fine-tuning data (a loss mask beside the tokens) among
    the datasets, and then every dataset of the blend is packed so: a batch's windows have one form."""
    from meshtron.data.blend import parse_blend
    from meshtron.data.sft import has_loss_mask

    if cfg.reset_per_document:
        return True
    if cfg.source != "indexed":  # streamed text is documents without a loss mask
        return False
    prefixes = parse_blend(list(cfg.blend)).prefixes if cfg.blend is not None else [cfg.path] if cfg.path else []
    return any(has_loss_mask(indexed_prefix(p) or p) for p in prefixes)


def tokens_of(sample: np.ndarray) -> np.ndarray:
    """A sample's tokens: the sample itself, or channel 0 of a window of packed documents (of both
    windows of a preference pair)."""
    return sample if sample.ndim == 1 else sample[..., 0].reshape(-1)


def _max_token(dataset: Any, pieces: int = 256, size: int = 4096) -> int:
    """The largest id among ``pieces`` spread-out reads of ``size`` tokens (a full scan would read,
    and keep resident, the whole corpus): catches a dataset written with another tokenizer."""
    total = dataset.total_tokens
    if total == 0:
        return 0
    starts = np.unique(np.linspace(0, max(total - size, 0), pieces).astype(np.int64))
    return int(max(dataset.read(int(s), int(min(size, total - s))).max() for s in starts))


def _bytes_per_token(data: TokenDatasets, eval_samples: int) -> float:
    """UTF-8 bytes per held-out token, by decoding the evaluation samples with ``data.tokenizer``."""
    if data.tokenizer.kind == BYTES:
        return 1.0
    count = min(len(data.heldout), eval_samples)
    ids = [tokens_of(data.heldout.sample(i))[1:] for i in range(count)]  # the predicted tokens
    text = sum(len(data.tokenizer.decode(row.tolist()).encode("utf-8")) for row in ids)
    return text / max(sum(len(r) for r in ids), 1)
