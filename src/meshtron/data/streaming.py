"""Training data read while the run trains: a local Hugging Face dataset (``data.source: hf``) or a
Grain data source (``data.source: grain``), tokenized on the fly and packed into windows.

Why: a corpus need not be pre-tokenised into ``.bin/.idx`` first; the text is tokenized with the
run's tokenizer (``data.tokenizer``) in a background thread, a few batches ahead of the step that
uses them, so tokenizing overlaps training.

**Examples.** A source is a sequence of examples (rows of Parquet or JSON-lines files, records of
ArrayRecord files, or a ``save_to_disk`` dataset), each holding a text in ``data.text_field``. The
last ``data.holdout_fraction`` of them (at least one) are the held-out examples, the rest the
training examples, as the documents of an indexed dataset are split. Epoch ``e`` takes the training
examples in file order (``hf``: a stream reads forwards) or in the order of Grain's index shuffle
seeded by ``(train.seed, e)`` (``grain``: its sources are random-access).

**Windows.** Each example's tokens (plus the tokenizer's end-of-document id, as ``meshtron
preprocess`` writes them) are laid end to end, epoch after epoch, and cut into windows of
``seq_len + 1`` tokens starting every ``seq_len`` tokens (the last target of a window is the first
input of the next, as in :mod:`meshtron.data.samples`). With packed documents
(``data.reset_per_document``) a window is ``[seq_len + 1, 3]``: tokens, the document's number within
the window (from 1) and a loss mask of ones, the layout of :mod:`meshtron.models.documents`.

**The position.** Where a window starts is a :class:`Cursor` -- ``(epoch, example, offset)``: the
``example``-th training example of epoch ``epoch``, ``offset`` tokens into it. The cursor where the
next batch starts is saved in the checkpoint's meta record beside the batch index
(:class:`meshtron.checkpoint.RunPosition`), and a resumed run starts reading there: it continues
with the next window, without tokenizing what came before (``hf`` skips the rows before it without
decoding them to tokens; ``grain`` seeks). Every step consumes one global batch (``train.batch_size``
windows, whatever the mesh), built whole in every process, so the cursor does not depend on the
number of data-parallel devices: a run restored onto another data size continues with the same
windows, none repeated or skipped. A checkpoint without a cursor (written by a run on another
``data.source``) is replayed from the start: the same windows, found by tokenizing again.

**Fine-tuning examples.** A source whose examples hold ``prompt`` and ``response`` or ``messages``
(and no ``data.text_field``) is supervised fine-tuning data: :class:`ExamplePacker` renders each with
the chat template and packs it whole, as :class:`meshtron.data.sft.PackedExamples` does.

**Preference pairs.** A source whose examples hold ``prompt``, ``chosen`` and ``rejected`` trains
``train.objective: dpo``: :class:`PairPacker` renders each pair as ``meshtron preprocess --preference``
does and gives it as one window ``[2, seq_len + 1, 3]`` laid out as
:class:`meshtron.data.preference.PreferencePairs` lays out a sample; a batch of ``train.batch_size``
pairs is ``[2·batch_size, seq_len + 1, 3]``, each pair's chosen row beside its rejected one, as
:class:`meshtron.data.sources.PairStream` lays it out.

**Blends.** ``data.blend`` ``[w1, path1, w2, path2, ...]`` mixes sources by weight with Megatron's
rule (:func:`meshtron.data.blend.blend_indices`, window by window); the cursor then holds each
source's cursor and how many windows each has given.
"""

from __future__ import annotations

import glob
import json
import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from meshtron.config import DataConfig
from meshtron.data.text import Batches
from meshtron.data.tokenizers import BYTES, Tokenizer
from meshtron.errors import ConfigError

EXTRAS = {"hf": ("datasets", "hf-data"), "grain": ("grain", "grain")}
PARQUET, JSON_LINES, ARRAY_RECORD = (".parquet",), (".jsonl", ".json"), (".array_record", ".arrayrecord")
PREFETCH_BATCHES = 4  # global batches tokenized ahead of the step
_UNIGRAM_WINDOWS = 256  # training windows the unigram baseline counts


def require(source: str) -> Any:
    """The package ``data.source`` reads with, or one line naming the extra that installs it."""
    package, extra = EXTRAS[source]
    try:
        return __import__(package)
    except ImportError:
        raise ConfigError(f"data.source: {source} needs the {package} package: pip install 'meshtron[{extra}]'") from None


class Cursor(NamedTuple):
    """Where a window starts: ``offset`` tokens into the ``example``-th training example of epoch ``epoch``."""

    epoch: int
    example: int
    offset: int


START = Cursor(0, 0, 0)


# ---- example sources ---------------------------------------------------------------------------


class ExampleSource(Protocol):
    """A dataset's examples, split into training and held-out ones."""

    name: str
    text_field: str
    train_examples: int
    heldout_examples: int

    def rows(self, epoch: int, start: int) -> Iterator[tuple[int, Any]]:
        """``(example id, row)`` of the training examples of ``epoch`` from the ``start``-th on: a row is
        a dict of fields, or a plain text (:func:`record`)."""

    def heldout_rows(self) -> Iterator[tuple[int, Any]]:
        """``(example id, row)`` of the held-out examples, in file order."""


def data_files(path: Path, suffixes: Sequence[str]) -> list[str]:
    """``path`` itself, or the files under the folder ``path`` ending in one of ``suffixes``, sorted."""
    if path.is_file():
        return [str(path)]
    return sorted(f for f in glob.glob(str(path / "**" / "*"), recursive=True) if f.endswith(tuple(suffixes)))


def _kind(path: Path, allowed: dict[str, Sequence[str]], field_name: str, source: str) -> tuple[str, list[str]]:
    """``(format, files)`` of a dataset path: the first format whose files it holds."""
    for kind, suffixes in allowed.items():
        files = data_files(path, suffixes)
        if files and (path.is_dir() or str(path).endswith(tuple(suffixes))):
            return kind, files
    wanted = ", ".join(s for suffixes in allowed.values() for s in suffixes)
    raise ConfigError(f"{field_name}: {str(path)!r} holds no {wanted} files that data.source={source} reads; "
                      f"give such a file or a folder of them")


def holdout_split(n: int, fraction: float, name: str) -> tuple[int, int]:
    """``(training, held-out)`` example counts: the last ``round(n * fraction)`` (at least 1) held out."""
    held = max(1, round(n * fraction))
    if n - held < 1:
        raise ConfigError(f"data.holdout_fraction: {fraction} of {name!r}'s {n} examples leaves none for training; "
                          "lower it or use a dataset with more examples")
    return n - held, held


def record(row: Any) -> dict | str:
    """A row as a dict of fields, or a plain text: an ArrayRecord record or a JSON line (bytes) is a
    JSON object when it starts with ``{``, else UTF-8 text."""
    if isinstance(row, bytes | bytearray):
        raw = bytes(row)
        return json.loads(raw) if raw.lstrip().startswith(b"{") else raw.decode("utf-8", errors="replace")
    return row


def _text_of(row: Any, text_field: str, name: str) -> str:
    row = record(row)
    if isinstance(row, str):
        return row
    if not isinstance(row, dict) or text_field not in row:
        columns = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
        raise ConfigError(f"data.text_field: {text_field!r} is not a field of {name}'s examples (they have: {columns}); "
                          "set data.text_field to the one holding the text")
    text = row[text_field]
    if not isinstance(text, str):
        raise ConfigError(f"data.text_field: {text_field!r} of {name}'s examples holds {type(text).__name__}, not text; "
                          "set data.text_field to the field holding the text")
    return text


class HuggingFaceSource:
    """A local Hugging Face dataset read with ``datasets``: Parquet or JSON-lines files through
    ``load_dataset(..., streaming=True)``, a ``save_to_disk`` folder through ``load_from_disk`` (as an
    iterable dataset). The example count comes from the files' metadata (Parquet), their lines
    (JSON lines) or the Arrow table, never from tokenizing.

    Every read (:meth:`rows`, :meth:`heldout_rows`) opens a dataset object of its own: a
    ``datasets`` iterable dataset keeps its read position in state its ``skip``/``take`` views share,
    and an iteration starting while another runs (the prefetching thread and the main thread's
    baseline) could start from the other's position -- rows then carry the wrong example numbers."""

    def __init__(self, path: str, text_field: str, holdout_fraction: float, field_name: str = "data.path"):
        datasets = require("hf")
        self.name, self.text_field = str(path), text_field
        root = Path(path)
        if root.is_dir() and ((root / "dataset_info.json").is_file() or (root / "dataset_dict.json").is_file()):
            loaded = datasets.load_from_disk(str(root))
            if isinstance(loaded, datasets.DatasetDict):
                raise ConfigError(f"{field_name}: {path!r} holds the splits {', '.join(loaded)}; give one split's "
                                  "folder (e.g. PATH/train)")
            count = len(loaded)
            self._open = loaded.to_iterable_dataset
        else:
            kind, files = _kind(root, {"parquet": PARQUET, "json": JSON_LINES}, field_name, "hf")
            count = _parquet_rows(files) if kind == "parquet" else _json_lines(files)
            self._open = partial(datasets.load_dataset, kind, data_files=files, split="train", streaming=True)
        self.train_examples, self.heldout_examples = holdout_split(count, holdout_fraction, self.name)
        self._opening = threading.Lock()

    def rows(self, epoch: int, start: int) -> Iterator[tuple[int, Any]]:
        del epoch  # a stream is read in file order every epoch
        stream = self._fresh()
        rows = stream.skip(start).take(self.train_examples - start) if start else stream.take(self.train_examples)
        yield from enumerate(rows, start)

    def heldout_rows(self) -> Iterator[tuple[int, Any]]:
        yield from enumerate(self._fresh().skip(self.train_examples), self.train_examples)

    def _fresh(self) -> Any:
        """The dataset opened anew, its read position its own (opened one at a time)."""
        with self._opening:
            return self._open()


def _parquet_rows(files: Sequence[str]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def _json_lines(files: Sequence[str]) -> int:
    count = 0
    for f in files:
        with open(f, "rb") as handle:
            count += sum(1 for line in handle if line.strip())
    return count


class _ParquetRows:
    """A random-access Grain data source over the rows of Parquet files (read once; only
    ``data.text_field`` when the files have it, else every column: supervised fine-tuning examples),
    ``len`` and ``[i]``."""

    def __init__(self, files: Sequence[str], text_field: str):
        import pyarrow.parquet as pq

        self._rows: list[dict] = []
        for f in files:
            columns = [text_field] if text_field in pq.read_schema(f).names else None
            self._rows.extend(pq.read_table(f, columns=columns).to_pylist())

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict:
        return self._rows[index]


class _JsonLines:
    """A random-access Grain data source over the lines of JSON-lines files (kept as bytes)."""

    def __init__(self, files: Sequence[str]):
        self._lines = []
        for f in files:
            with open(f, "rb") as handle:
                self._lines.extend(line for line in handle if line.strip())

    def __len__(self) -> int:
        return len(self._lines)

    def __getitem__(self, index: int) -> bytes:
        return self._lines[index]


class GrainSource:
    """Examples through a Grain data source: ``grain.sources.ArrayRecordDataSource`` over ArrayRecord
    files (each record UTF-8 text, or a JSON object holding ``data.text_field``), or a random-access
    source over Parquet's text column or JSON lines. The training examples are a
    ``grain.MapDataset`` sliced from the source and shuffled per epoch (Grain's index shuffle, seeded
    by ``(seed, epoch)``); reading runs in Grain's threads (``to_iter_dataset``)."""

    def __init__(self, path: str, text_field: str, holdout_fraction: float, seed: int, field_name: str = "data.path"):
        grain = require("grain")
        self._grain, self.name, self.text_field, self.seed = grain, str(path), text_field, seed
        kind, files = _kind(Path(path), {"array_record": ARRAY_RECORD, "parquet": PARQUET, "json": JSON_LINES},
                            field_name, "grain")
        if kind == "array_record":
            source = grain.sources.ArrayRecordDataSource(files)
        elif kind == "parquet":
            source = _ParquetRows(files, text_field)
        else:
            source = _JsonLines(files)
        self._source = grain.MapDataset.source(source)
        self.train_examples, self.heldout_examples = holdout_split(len(source), holdout_fraction, self.name)

    def _epoch_seed(self, epoch: int) -> int:
        return int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0])

    def order(self, epoch: int) -> Any:
        """The training example ids of ``epoch`` in the order they are read (a ``grain.MapDataset``)."""
        return self._grain.MapDataset.range(self.train_examples).shuffle(seed=self._epoch_seed(epoch))

    def rows(self, epoch: int, start: int) -> Iterator[tuple[int, Any]]:
        source = self._source
        rows = self.order(epoch)[start:].map(lambda j: (int(j), source[int(j)]))
        yield from rows.to_iter_dataset(self._grain.ReadOptions(num_threads=2, prefetch_buffer_size=64))

    def heldout_rows(self) -> Iterator[tuple[int, Any]]:
        for j in range(self.train_examples, self.train_examples + self.heldout_examples):
            yield j, self._source[j]


def open_source(cfg: DataConfig, path: str, seed: int, field_name: str) -> ExampleSource:
    if cfg.source == "hf":
        return HuggingFaceSource(path, cfg.text_field, cfg.holdout_fraction, field_name)
    return GrainSource(path, cfg.text_field, cfg.holdout_fraction, seed, field_name)


# ---- tokens and windows ------------------------------------------------------------------------


def encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """A document's ids, followed by the end-of-document id when the tokenizer has one (as ``meshtron
    preprocess`` writes it); empty for an empty document."""
    if tokenizer.kind == BYTES:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    ids = tokenizer.encode(text)
    if ids and tokenizer.eod is not None:
        ids = [*ids, tokenizer.eod]
    return np.asarray(ids, np.int32)


@dataclass
class _Piece:
    cursor: Cursor  # where the piece's first token is
    example_id: int
    tokens: np.ndarray


class Window(NamedTuple):
    """A packed window and what it holds: the cursor of its first token and the example ids it reads
    (each once, in order)."""

    tokens: np.ndarray  # [seq_len + 1] or [seq_len + 1, 3]
    start: Cursor
    examples: tuple[tuple[int, int], ...]  # (epoch, example id) of each example it reads


class Packer:
    """Windows of ``seq_len + 1`` tokens from one source's training examples, from a cursor on.
    A source whose epoch holds no tokens ends the windows (:class:`StopIteration`)."""

    def __init__(self, source: ExampleSource, tokenizer: Tokenizer, seq_len: int, documents: bool,
                 cursor: Cursor = START):
        self.source, self.tokenizer, self.seq_len, self.documents = source, tokenizer, seq_len, documents
        self.cursor = self._last = Cursor(*cursor)
        self._reading: int | None = None  # the id of the example being tokenized, for messages
        self._pieces: deque[_Piece] = deque()
        self._buffered = 0
        self._examples = self._read(self.cursor)

    def _read(self, cursor: Cursor) -> Iterator[_Piece]:
        epoch, start, offset = cursor
        while True:
            found = False
            for position, (example_id, row) in enumerate(self.source.rows(epoch, start), start):
                self._reading = example_id
                tokens = self.tokens(row)[offset:]
                if len(tokens):
                    found = True
                    yield _Piece(Cursor(epoch, position, offset), example_id, tokens)
                offset = 0
            if not found and start == 0:
                return
            self._epoch_read(epoch, start)
            epoch, start = epoch + 1, 0

    def _epoch_read(self, epoch: int, start: int) -> None:
        """The examples of ``epoch`` from the ``start``-th on have been read (tokenized)."""

    def tokens(self, row: Any) -> np.ndarray:
        """An example's tokens: its text field's, with the end-of-document id."""
        return encode(self.tokenizer, _text_of(row, self.source.text_field, self.source.name))

    def next_window(self) -> Window:
        """The window at :attr:`cursor`, which then moves ``seq_len`` tokens on."""
        need = self.seq_len + 1
        while self._buffered < need:
            piece = next(self._examples)
            self._pieces.append(piece)
            self._buffered += len(piece.tokens)
        out = np.empty(need, np.int32)
        segments = np.empty(need, np.int32)
        examples, filled = [], 0
        for number, piece in enumerate(self._pieces, 1):
            take = min(need - filled, len(piece.tokens))
            out[filled:filled + take] = piece.tokens[:take]
            segments[filled:filled + take] = number
            examples.append((piece.cursor.epoch, piece.example_id))
            filled += take
            if filled == need:
                break
        start = self._pieces[0].cursor
        self._advance(self.seq_len)
        window = np.stack([out, segments, np.ones_like(out)], axis=-1) if self.documents else out
        return Window(window, start, tuple(examples))

    def _advance(self, count: int) -> None:
        while count:
            piece = self._pieces[0]
            self._last = piece.cursor
            if len(piece.tokens) <= count:
                count -= len(piece.tokens)
                self._buffered -= len(piece.tokens)
                self._pieces.popleft()
                continue
            c = piece.cursor
            self._pieces[0] = _Piece(Cursor(c.epoch, c.example, c.offset + count), piece.example_id,
                                     piece.tokens[count:])
            self._buffered -= count
            count = 0
        if self._pieces:
            self.cursor = self._pieces[0].cursor
        else:  # the next window starts at the next example (past an epoch's last: the next epoch's first)
            self.cursor = Cursor(self._last.epoch, self._last.example + 1, 0)


class ExamplePacker(Packer):
    """Supervised fine-tuning examples (``{"prompt", "response"}`` or ``{"messages": [...]}`` rows),
    rendered with meshtron's chat template (:class:`meshtron.data.sft.ChatTemplate`: the loss on the
    answers alone) and packed whole, as :class:`meshtron.data.sft.PackedExamples` packs them: a window
    closes when the next example does not fit (the rest is padding, outside every document, its loss
    masked), an example longer than a window is cut to it, and each example is its own document.
    Windows are ``[seq_len + 1, 3]``: tokens, document number, loss mask. A cursor's offset is always 0."""

    def __init__(self, *args: Any, **kwargs: Any):
        from meshtron.data.sft import ChatTemplate

        super().__init__(*args, **kwargs)
        self.template = ChatTemplate(self.tokenizer)
        self._pending: _Piece | None = None
        self.answers = AnswerCount(self.seq_len)
        self.report: str | None = None  # the field that named the data: count lost answers per first epoch

    def tokens(self, row: Any) -> np.ndarray:
        """``[n, 2]``: the example's ids and loss mask."""
        from meshtron.data.sft import messages_of

        try:
            messages = messages_of(fields(row), f"an example of {self.source.name}")
        except ConfigError as err:
            raise ConfigError(str(err).replace("--input: ", "data.path: ", 1)) from None
        ids, mask = self.template.render(messages)
        self.answers.add(mask)
        return np.stack([ids, mask], axis=-1).astype(np.int32)

    def _epoch_read(self, epoch: int, start: int) -> None:
        """After a whole epoch read from its start, the count of examples whose answer the window cut off
        (one line; the examples :func:`check_streamed_answers` read when the data was opened are all of
        them when the source is small, and then they were counted there)."""
        if self.report is not None and start == 0 and self.answers.total > ANSWER_PROBE:
            self.answers.check(self.report, self.source.name, "training", refuse=False)
        self.report = None  # once: every epoch holds the same examples

    def next_window(self) -> Window:
        room = self.seq_len + 1
        out = np.zeros((room, 3), np.int32)
        filled, examples, start = 0, [], None
        while filled < room:
            if self._pending is None:
                try:
                    self._pending = next(self._examples)
                except StopIteration:  # the held-out examples are used up: the last window is padded
                    if filled:
                        break
                    raise
            piece = self._pending
            length = min(len(piece.tokens), room)
            if filled + length > room:
                break
            out[filled:filled + length, 0] = piece.tokens[:length, 0]
            out[filled:filled + length, 1] = len(examples) + 1
            out[filled:filled + length, 2] = piece.tokens[:length, 1]
            examples.append((piece.cursor.epoch, piece.example_id))
            start = start or piece.cursor
            filled += length
            self._last, self._pending = piece.cursor, None
        self.cursor = (self._pending.cursor if self._pending is not None else
                       Cursor(self._last.epoch, self._last.example + 1, 0))
        return Window(out, start, tuple(examples))


ANSWER_PROBE = 256  # fine-tuning examples of each split read when the data is opened, to check their answers


class AnswerCount:
    """How many fine-tuning examples a window of ``seq_len + 1`` tokens cuts before their first counted
    target (``answer_starts`` of :mod:`meshtron.data.sft`: the first mask 1 after the first token), and
    the window that keeps every answer: the rule :func:`meshtron.data.sft.check_answers` applies to an
    indexed dataset, applied to the examples as they are read."""

    def __init__(self, seq_len: int):
        self.seq_len, self.total, self.lost, self.need = seq_len, 0, 0, 0

    def add(self, mask: np.ndarray) -> None:
        counted = np.flatnonzero(np.asarray(mask)[1:])
        if not len(counted):
            return
        start = int(counted[0]) + 1
        self.total += 1
        self.lost += start > self.seq_len
        self.need = max(self.need, start)

    def check(self, field_name: str, name: str, kind: str, *, refuse: bool, first: bool = False) -> None:
        """Refuse (``refuse``: training examples) when every example counted lost its answer; one line on
        stderr when some did. ``first``: the count is of the first examples only."""
        from meshtron.data.sft import warn

        if not self.lost:
            return
        some = f"the first {self.total}" if first else f"the {self.total}"
        if refuse and self.lost == self.total:
            raise ConfigError(f"{field_name}: every one of {some} {kind} examples of {name} loses its answer at "
                              f"model.seq_len={self.seq_len} (cut to seq_len + 1 tokens before its first counted "
                              f"token), so the run would learn nothing; use a longer model.seq_len "
                              f"(model.seq_len={self.need} keeps every answer) or shorter examples")
        warn(f"{field_name}: {self.lost} of {some} {kind} examples of {name} lose their answer at "
              f"model.seq_len={self.seq_len} (cut before their first counted token) and count for nothing; "
              f"model.seq_len={self.need} keeps every answer, or shorten those examples")


def check_streamed_answers(source: ExampleSource, tokenizer: Tokenizer, seq_len: int, field_name: str) -> None:
    """Read the first :data:`ANSWER_PROBE` training and held-out fine-tuning examples of ``source`` (the
    training ones on until one keeps its answer, so that a refusal is only for data none of whose
    answers fits) and apply :meth:`AnswerCount.check`: refused when every training example loses its
    answer at ``seq_len``, one line when some of those read do (the count over a whole epoch follows at
    its end)."""
    splits = (("training", source.rows(0, 0), source.train_examples),
              ("held-out", source.heldout_rows(), source.heldout_examples))
    for kind, rows, count in splits:
        packer, read = ExamplePacker(source, tokenizer, seq_len, True), 0
        for _, row in rows:
            packer.tokens(row)
            read += 1
            answers = packer.answers
            if read >= ANSWER_PROBE and (kind == "held-out" or answers.lost < answers.total):
                break
        packer.answers.check(field_name, source.name, kind, refuse=kind == "training", first=read < count)


class PairPacker(Packer):
    """Preference pairs (``{"prompt", "chosen", "rejected"}`` rows, each a string or chat messages, as
    ``meshtron preprocess --preference`` reads them), rendered as it renders them
    (:func:`meshtron.data.preference.render_pair`) and laid out as
    :class:`meshtron.data.preference.PreferencePairs` lays out a sample: a window is one pair,
    ``[2, seq_len + 1, 3]`` -- the chosen conversation then the rejected one, each one document from
    the window's start, cut to it, padding after it. A pair whose answer the window cuts off whole is
    refused when it is read (the run's data thread hands the error to the step), as the indexed path
    refuses it before the first step. A cursor's offset is always 0."""

    def __init__(self, *args: Any, **kwargs: Any):
        from meshtron.data.sft import ChatTemplate

        super().__init__(*args, **kwargs)
        self.template = ChatTemplate(self.tokenizer)

    def tokens(self, row: Any) -> np.ndarray:
        """``[2, seq_len + 1, 3]``: the pair's window."""
        from meshtron.data.preference import pair_of, render_pair

        try:
            messages = pair_of(fields(row), f"an example of {self.source.name}")
        except ConfigError as err:
            raise ConfigError(str(err).replace("--input: ", "data.path: ", 1)) from None
        room = self.seq_len + 1
        out = np.zeros((2, room, 3), np.int32)
        for k, (ids, mask) in enumerate(render_pair(self.template, *messages)):
            starts = np.flatnonzero(mask[1:]) + 1
            if not len(starts) or starts[0] > self.seq_len:
                need = int(starts[0]) if len(starts) else len(ids)
                raise ConfigError(f"data.path: a pair of {self.source.name} (example {self._reading}) loses its "
                                  f"{('chosen', 'rejected')[k]} answer at model.seq_len={self.seq_len} (cut before its "
                                  f"first counted token); use model.seq_len={need} or more, or shorter prompts")
            length = min(len(ids), room)
            out[k, :length, 0], out[k, :length, 1], out[k, :length, 2] = ids[:length], 1, mask[:length]
        return out

    def next_window(self) -> Window:
        piece = next(self._examples)
        self._last = piece.cursor
        self.cursor = Cursor(piece.cursor.epoch, piece.cursor.example + 1, 0)
        return Window(piece.tokens, piece.cursor, ((piece.cursor.epoch, piece.example_id),))


def fields(row: Any) -> dict | str:
    """A row's fields that hold a value (a table unifies its rows' fields, filling the others with None)."""
    row = record(row)
    return {k: v for k, v in row.items() if v is not None} if isinstance(row, dict) else row


def is_pair(row: Any, text_field: str) -> bool:
    """Whether a row is a preference pair: no ``text_field``, and ``prompt``, ``chosen`` and ``rejected``."""
    row = fields(row)
    return isinstance(row, dict) and text_field not in row and {"prompt", "chosen", "rejected"} <= row.keys()


def is_sft(row: Any, text_field: str) -> bool:
    """Whether a row is a supervised fine-tuning example rather than a text: no ``text_field``, and
    ``messages`` or ``prompt`` and ``response``."""
    row = fields(row)
    return (isinstance(row, dict) and text_field not in row
            and ("messages" in row or {"prompt", "response"} <= row.keys()))


class WindowStream:
    """Windows from one source, or from several blended by weight (Megatron's rule, window by
    window), and the state that restarts them: :meth:`state` / ``WindowStream(..., state=)``."""

    def __init__(self, packers: Sequence[Packer], weights: Sequence[float], taken: Sequence[int] | None = None):
        from meshtron.data.blend import normalize

        self.packers, self.weights = list(packers), normalize(weights)
        self.taken = list(taken) if taken is not None else [0] * len(self.packers)

    def next_window(self) -> tuple[int, Window]:
        """``(source, window)``: the next window of the blend."""
        d = 0
        if len(self.packers) > 1:
            i = sum(self.taken)
            scale = float(i) if i > 1 else 1.0
            errors = [w * scale - t if w > 0 else -np.inf for w, t in zip(self.weights, self.taken)]
            d = int(np.argmax(errors))  # the first of equal errors, as blend_indices
        self.taken[d] += 1
        return d, self.packers[d].next_window()

    def state(self) -> dict[str, Any]:
        """What the checkpoint saves: each source's cursor and how many windows it has given."""
        return {"cursors": [list(p.cursor) for p in self.packers], "taken": list(self.taken)}


class StreamBatch(NamedTuple):
    tokens: np.ndarray  # [batch, seq_len + 1(, 3)]
    windows: list[tuple[int, Window]]  # (source, window) of each row
    state_after: dict[str, Any]


class StreamBatches(Batches):
    """Global batches of windows from a :class:`WindowStream`, tokenized by a background thread
    :data:`PREFETCH_BATCHES` batches ahead. Batches come in order only (:meth:`next`); the state of
    the batch at :attr:`position` is :meth:`cursor`. ``rows_per_window``: 2 for preference pairs (a
    window is a pair, its chosen row then its rejected one, as :class:`meshtron.data.sources.PairStream`
    lays them out), else 1."""

    def __init__(self, make_stream, *, batch_size: int, window: int, channels: tuple[int, ...], position: int,
                 state: dict[str, Any] | None, rows_per_window: int = 1):
        super().__init__(batch_size=batch_size, window=window, position=position, channels=channels)
        self.rows_per_window = rows_per_window
        stream = make_stream(state)
        replay = position if state is None else 0  # no saved cursor: find the position by reading again
        self._state = stream.state()
        self._current: StreamBatch | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=PREFETCH_BATCHES)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(stream, replay), daemon=True,
                                        name="meshtron-stream")
        self._thread.start()

    def _batch(self, stream: WindowStream) -> StreamBatch:
        windows = [stream.next_window() for _ in range(self.batch_size // self.rows_per_window)]
        tokens = np.stack([w.tokens for _, w in windows]).reshape(self.batch_size, self.window, *self.channels)
        return StreamBatch(tokens, windows, stream.state())

    def _fill(self, stream: WindowStream, replay: int) -> None:
        try:
            for _ in range(replay):
                self._batch(stream)
            self._state = stream.state()
            while not self._stop.is_set():
                item = self._batch(stream)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except StopIteration:
            names = ", ".join(p.source.name for p in stream.packers)
            self._queue.put(ConfigError(f"data.path: the training examples of {names} hold no text; check "
                                        "data.text_field"))
        except Exception as err:  # noqa: BLE001 - handed to the training thread, which raises it
            self._queue.put(err)

    def _take(self) -> StreamBatch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def rows(self, index: int, row_slice: slice) -> np.ndarray:
        if self._current is None or index != self.position:
            raise IndexError(f"a streamed data source serves its batches in order: batch {self.position} is next, "
                             f"not {index}")
        return self._current.tokens[row_slice]

    def next(self, sharding):
        if self._current is not None:
            self._state = self._current.state_after
        self._current = self._take()
        array = self.batch(self.position, sharding)
        self.position += 1
        return array

    @property
    def current(self) -> StreamBatch | None:
        """The batch :meth:`next` returned last (its windows and their example ids)."""
        return self._current

    def cursor(self) -> dict[str, Any] | None:
        """Where the batch at :attr:`position` starts: what the checkpoint saves."""
        return self._current.state_after if self._current is not None else self._state

    def close(self) -> None:
        self._stop.set()


class FixedWindows(Batches):
    """Batches of windows computed once (the held-out set): batch ``i`` is windows ``i·B .. i·B + B - 1``
    (modulo their number), the same at every evaluation."""

    def __init__(self, windows: np.ndarray, *, batch_size: int):
        super().__init__(batch_size=batch_size, window=windows.shape[1], channels=windows.shape[2:])
        self.windows = windows

    def rows(self, index: int, row_slice: slice) -> np.ndarray:
        first = index * self.batch_size
        picked = [(first + r) % len(self.windows) for r in range(self.batch_size)[row_slice]]
        return self.windows[picked]


@dataclass
class StreamedData:
    """Streamed training data behind the interface of :mod:`meshtron.data.sources`."""

    sources: list[ExampleSource]
    packers: list[type[Packer]]  # per source: Packer (texts), ExamplePacker (fine-tuning examples), PairPacker
    weights: list[float]
    tokenizer: Tokenizer
    seq_len: int
    documents: bool
    heldout: np.ndarray  # the fixed held-out windows
    source: str
    vocab_size: int
    heldout_bytes_per_token: float = 1.0
    field_name: str = "data.path"  # the setting that named the data (data.path or data.blend), for messages
    _unigram: float | None = field(default=None, repr=False)

    def windows(self, state: dict[str, Any] | None = None, report: str | None = None) -> WindowStream:
        """The training windows from ``state`` on (None: the start); ``report``: the field that named the
        data, for the count of fine-tuning answers the window cuts off over the first epoch read whole."""
        cursors = state["cursors"] if state else [START] * len(self.sources)
        if len(cursors) != len(self.sources):
            raise ConfigError(f"data.blend: the checkpoint's read position is for {len(cursors)} source(s), this run "
                              f"reads {len(self.sources)}; resume with the blend that wrote it, or use another "
                              "checkpoint.dir")
        packers = [kind(s, self.tokenizer, self.seq_len, self.documents, Cursor(*c))
                   for kind, s, c in zip(self.packers, self.sources, cursors)]
        for packer in packers:
            if isinstance(packer, ExamplePacker):
                packer.report = report
        return WindowStream(packers, self.weights, state["taken"] if state else None)

    @property
    def preference(self) -> bool:
        """Whether the examples are preference pairs (``batch_size`` counts pairs, two rows each)."""
        return PairPacker in self.packers

    def train_stream(self, *, batch_size: int, seq_len: int, seed: int, position: int = 0,
                     cursor: dict[str, Any] | None = None) -> StreamBatches:
        del seq_len, seed  # fixed when the data was opened
        per = 2 if self.preference else 1
        channels = (3,) if self.documents or self.preference else ()
        return StreamBatches(partial(self.windows, report=self.field_name), batch_size=per * batch_size, window=self.seq_len + 1, channels=channels,
                             position=position, state=cursor, rows_per_window=per)

    def heldout_stream(self, *, batch_size: int, seq_len: int, seed: int) -> Batches:
        del seq_len, seed
        return FixedWindows(self.heldout, batch_size=(2 if self.preference else 1) * batch_size)

    def unigram_loss(self) -> float:
        """Held-out cross-entropy under the unigram frequencies of the first training windows."""
        if self._unigram is None:
            stream = self.windows()
            counts = np.ones(self.vocab_size, np.float64)
            for _ in range(_UNIGRAM_WINDOWS):
                tokens = stream.next_window()[1].tokens
                counts += np.bincount(tokens if tokens.ndim == 1 else tokens[..., 0].reshape(-1),
                                      minlength=self.vocab_size)
            log_probs = np.log(counts / counts.sum())
            held = self.heldout if self.heldout.ndim == 2 else self.heldout[..., 0]
            self._unigram = float(-log_probs[np.minimum(held, self.vocab_size - 1)].mean())
        return self._unigram


def heldout_windows(sources: Sequence[ExampleSource], kinds: Sequence[type[Packer]], tokenizer: Tokenizer,
                    seq_len: int, documents: bool, count: int) -> tuple[np.ndarray, float]:
    """The first ``count`` windows of the held-out examples (the sources' in turn, each packed on its
    own), and the UTF-8 bytes per predicted token of their text."""
    windows: list[np.ndarray] = []
    for source, kind in zip(sources, kinds):
        packer = kind(_HeldOut(source), tokenizer, seq_len, documents)
        share = -(-count // len(sources))
        for _ in range(share):
            try:
                windows.append(packer.next_window().tokens)
            except StopIteration:  # the held-out examples are used up
                break
    if len(windows) < count:
        raise ConfigError(f"data.holdout_fraction: the held-out examples of {', '.join(s.name for s in sources)} "
                          f"give {len(windows)} windows of {seq_len + 1} tokens, fewer than the {count} an evaluation "
                          "reads (train.eval_batches x train.batch_size); raise data.holdout_fraction")
    stacked = np.stack(windows[:count])
    if stacked.ndim == 4:  # preference pairs: each pair's chosen row then its rejected one
        stacked = stacked.reshape(-1, *stacked.shape[2:])
    if tokenizer.kind == BYTES:
        return stacked, 1.0
    ids = stacked if stacked.ndim == 2 else stacked[..., 0]
    real = np.ones_like(ids, bool) if stacked.ndim == 2 else stacked[..., 1] > 0  # not a fine-tuning window's padding
    predicted = [row[1:][keep[1:]] for row, keep in zip(ids, real)]
    text = sum(len(tokenizer.decode(row.tolist()).encode("utf-8")) for row in predicted)
    return stacked, text / max(sum(len(row) for row in predicted), 1)


class _HeldOut:
    """A source's held-out examples, read once in file order (no epochs: packing stops at their end)."""

    def __init__(self, source: ExampleSource):
        self.name, self.text_field, self._source = source.name, source.text_field, source

    def rows(self, epoch: int, start: int) -> Iterator[tuple[int, Any]]:
        if epoch:
            return iter(())
        return self._source.heldout_rows()


def load_streamed(cfg: DataConfig, *, seq_len: int, vocab_size: int, seed: int, eval_samples: int,
                  tokenizer: Tokenizer, documents: bool) -> StreamedData:
    """``data.path`` (or ``data.blend``) opened as ``data.source``, with its held-out windows."""
    from meshtron.data.blend import parse_blend

    if cfg.blend is not None:
        blend = parse_blend(list(cfg.blend))
        weights, paths, field_name = blend.weights, blend.prefixes, "data.blend"
    else:
        weights, paths, field_name = [1.0], [str(cfg.path)], "data.path"
    sources = [open_source(cfg, path, seed, field_name) for path in paths]
    kinds = []
    for source in sources:
        first = next(iter(source.rows(0, 0)), (0, ""))[1]
        kinds.append(PairPacker if is_pair(first, cfg.text_field) else
                     ExamplePacker if is_sft(first, cfg.text_field) else Packer)
        if kinds[-1] is PairPacker and len(sources) > 1:
            raise ConfigError(f"data.blend: {source.name} holds preference pairs (prompt, chosen, rejected), which "
                              "train alone; give it as data.path")
        if kinds[-1] is ExamplePacker and not documents:
            raise ConfigError(f"data.reset_per_document: {source.name} holds fine-tuning examples (prompt/response or "
                              "messages), which train packed as documents with their answers' loss mask; set "
                              "data.reset_per_document=true")
        if kinds[-1] is ExamplePacker:
            check_streamed_answers(source, tokenizer, seq_len, field_name)
    heldout, per_token = heldout_windows(sources, kinds, tokenizer, seq_len, documents, eval_samples)
    high = int((heldout if heldout.ndim == 2 else heldout[..., 0]).max())
    if high >= vocab_size:
        raise ConfigError(f"model.vocab_size: {tokenizer.source} gives token id {high}; set model.vocab_size={high + 1} "
                          "or more")
    name = (f"{cfg.source} {paths[0]}" if len(paths) == 1 else
            f"{cfg.source} blend " + ", ".join(f"{w:.3g} x {p}" for w, p in zip(weights, paths)))
    return StreamedData(sources, kinds, list(weights), tokenizer, seq_len, documents, heldout,
                        f"{name}, tokenizer {tokenizer.source}", vocab_size, per_token, field_name)
