"""Text -> tokens -> a Megatron-LM indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), in parallel.

What Megatron's ``tools/preprocess_data.py`` does without ``--split-sentences``, in one process or a
pool of tokenizing workers: each document becomes one sequence, its token ids followed by the
tokenizer's end-of-document id (none for a document that tokenizes to nothing, which is written as
an empty document, as Megatron does; none at all for the byte tokenizer, which has no such id). Token
dtype: uint16 below 65,500 ids, else int32 (:func:`meshtron.data.indexed.best_dtype`). The output
is the same, byte for byte, whatever the number of workers.
"""

from __future__ import annotations

import glob
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from meshtron.data.indexed import META_FORMAT, WrittenTogether, best_dtype, meta_path, strip_suffix
from meshtron.data.tokenizers import BYTES, Tokenizer, load_tokenizer, tokenizer_record
from meshtron.errors import ConfigError

JSON_SUFFIXES = (".jsonl", ".json")
BATCH_BYTES = 1 << 20  # text sent to a worker at a time
BATCH_DOCUMENTS = 2048
PLAIN_PROGRESS_SECONDS = 10.0
MB = 1e6


@dataclass(frozen=True)
class PreprocessStats:
    """What a :func:`preprocess` run did (MB = 10^6 bytes of input)."""

    prefix: str
    files: int
    documents: int
    tokens: int
    bytes_in: int
    seconds: float
    dtype: str
    workers: int

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / MB / self.seconds if self.seconds > 0 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        return (f"preprocessed {self.documents:,} documents from {self.files} file(s), {self.bytes_in / MB:,.1f} MB, "
                f"into {self.tokens:,} {self.dtype} tokens at {self.prefix}.bin/.idx in {self.seconds:.1f} s "
                f"with {self.workers} worker(s): {self.mb_per_s:,.2f} MB/s, {self.tokens_per_s:,.0f} tokens/s")

    def as_dict(self) -> dict:
        return {**asdict(self), "mb_per_s": self.mb_per_s, "tokens_per_s": self.tokens_per_s}


def expand_inputs(inputs: str | Path | Sequence[str | Path]) -> list[Path]:
    """Paths and globs -> the files, each glob's matches sorted, in the order given (a file matched
    twice is read once)."""
    if isinstance(inputs, str | Path):
        inputs = [inputs]
    if not inputs:
        raise ConfigError("--input: no input given; give text or JSONL files (paths or globs)")
    files: dict[Path, None] = {}
    for item in inputs:
        text = str(item)
        if glob.has_magic(text):
            matches = sorted(Path(m) for m in glob.glob(text, recursive=True) if Path(m).is_file())
            if not matches:
                raise ConfigError(f"--input: {text!r} matches no file; check the pattern (and quote it so that "
                                  "meshtron, not the shell, expands it)")
        else:
            path = Path(text)
            if path.is_dir():
                raise ConfigError(f"--input: {text!r} is a directory; give its files, e.g. {text.rstrip('/')}/*.jsonl")
            if not path.is_file():
                raise ConfigError(f"--input: {text!r} does not exist; give text or JSONL files (paths or globs)")
            matches = [path]
        for path in matches:
            files.setdefault(path.resolve(), None)
    return list(files)


def input_names(files: Sequence[Path], shown: int = 3) -> str:
    """The input files for a message: all of a few, else the first ``shown`` and how many in all."""
    names = ", ".join(map(str, files[:shown]))
    return names if len(files) <= shown else f"{names}, ... ({len(files)} files)"


def refuse_empty(files: Sequence[Path], documents: int, tokens: int, unit: str = "documents",
                 fix: str = "give files with text") -> None:
    """An input with nothing to train on is a mistake (a wrong glob, an empty export): one line, raised
    before anything is put in place, so a good dataset at the output is never replaced by an empty one."""
    if tokens == 0:
        held = f"only {documents} empty {unit}" if documents else f"no {unit[:-1]}"
        raise ConfigError(f"--input: {input_names(files)} holds {held} (empty, or blank lines only); {fix} "
                          "(nothing was written)")


def dataset_meta(tokenizer: Tokenizer, documents: int, tokens: int, *, append_eod: bool, sft: bool = False) -> str:
    """The metadata sidecar (``PREFIX.meta.json``, :func:`meshtron.data.indexed.read_meta`) of a dataset
    written here: the tokenizer that wrote it -- what a run checks its own against -- and the counts
    that tie the record to these very files."""
    record = {"format": META_FORMAT, "version": 1, "tokenizer": tokenizer_record(tokenizer),
              "documents": int(documents), "tokens": int(tokens),
              "append_eod": bool(append_eod and (sft or tokenizer.eod is not None)), "sft": sft}
    return json.dumps(record, indent=1) + "\n"


def _tokenizer_spec(tokenizer: str | Path | Tokenizer | None) -> str:
    if tokenizer is None or isinstance(tokenizer, str | Path):
        return str(tokenizer or BYTES)
    return BYTES if tokenizer.kind == BYTES else str(tokenizer.path)


# -- the tokenizing side (a worker process, or this one) -------------------------------------------

_worker: dict = {}


def _init_worker(spec: str, json_key: str, append_eod: bool, dtype: str, pooled: bool = False) -> None:
    if pooled:  # one tokenizing thread a worker (the workers are the parallelism), unless the user said otherwise
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = load_tokenizer(spec)
    eod = tokenizer.eod if append_eod else None
    _worker.update(tokenizer=tokenizer, json_key=json_key, eod=eod, dtype=np.dtype(dtype))


def _text(path: str, line: int | None, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f"{path}:{line}" if line is not None else path
        raise ConfigError(f"--input: {where} is not UTF-8 ({err.reason} at byte {err.start}); convert the file "
                          "to UTF-8") from None


def _json_text(path: str, line: int, raw: bytes, key: str) -> str:
    try:
        record = json.loads(_text(path, line, raw))
    except json.JSONDecodeError as err:
        raise ConfigError(f"--input: {path}:{line} is not JSON ({err.msg} at column {err.colno}); a .jsonl/.json "
                          "file holds one JSON object per line") from None
    if not isinstance(record, dict) or key not in record:
        keys = ", ".join(map(str, record)) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise ConfigError(f"--input: {path}:{line} has no {key!r} field ({keys or 'no fields'}); pass --json-key "
                          "with the field that holds the text")
    text = record[key]
    if not isinstance(text, str):
        raise ConfigError(f"--input: {path}:{line}: field {key!r} is a JSON {type(text).__name__}, not a string")
    return text


def _encode_batch(batch: tuple[str, bool, list[tuple[int | None, bytes]]]) -> tuple[np.ndarray, np.ndarray]:
    """One batch of (line number, raw document) -> (flat tokens in the output dtype, each document's
    token count)."""
    path, is_json, lines = batch
    tokenizer, key, eod, dtype = _worker["tokenizer"], _worker["json_key"], _worker["eod"], _worker["dtype"]
    if is_json:
        texts = [_json_text(path, number, raw, key) for number, raw in lines]
    else:
        texts = [_text(path, None, raw) for _, raw in lines]
    if hasattr(tokenizer, "encode_bytes"):  # bytes: no Python list of ints on the way
        encoded = [np.frombuffer(tokenizer.encode_bytes(t), np.uint8) for t in texts]
    elif hasattr(tokenizer, "encode_batch"):
        encoded = tokenizer.encode_batch(texts)
    else:
        encoded = [tokenizer.encode(t) for t in texts]
    lengths = np.fromiter((len(ids) + (eod is not None and len(ids) > 0) for ids in encoded), np.int64, len(encoded))
    pieces = itertools.chain.from_iterable(
        itertools.chain(ids, (eod,)) if eod is not None and len(ids) else ids for ids in encoded)
    try:
        tokens = np.fromiter(pieces, dtype, int(lengths.sum()))
    except OverflowError as err:
        raise ConfigError(f"--tokenizer: {tokenizer.source} produced an id that does not fit {dtype.name} "
                          f"({err}); its vocab_size ({tokenizer.vocab_size}) is wrong") from None
    return tokens, lengths


# -- the reading and writing side (this process) ---------------------------------------------------

def _batches(files: list[Path], progress) -> Iterator[tuple[str, bool, list]]:
    """Documents in input order, in batches of about BATCH_BYTES; advances ``progress`` by bytes read."""
    for path in files:
        name = str(path)
        if path.suffix.lower() in JSON_SUFFIXES:
            with path.open("rb") as f:
                batch, size = [], 0
                for number, raw in enumerate(f, start=1):
                    progress(len(raw))
                    if not raw.strip():
                        continue  # blank lines are not documents
                    batch.append((number, raw))
                    size += len(raw)
                    if size >= BATCH_BYTES or len(batch) >= BATCH_DOCUMENTS:
                        yield name, True, batch
                        batch, size = [], 0
                if batch:
                    yield name, True, batch
        else:
            raw = path.read_bytes()
            progress(len(raw))
            yield name, False, [(None, raw)]


class _Progress:
    """Bytes read: a rich bar on a terminal, a plain line every PLAIN_PROGRESS_SECONDS otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = self.last = time.perf_counter()
        self._bar = None
        if enabled and sys.stdout.isatty():
            from rich import progress as rp

            self._bar = rp.Progress(rp.TextColumn("preprocess"), rp.BarColumn(), rp.DownloadColumn(),
                                    rp.TransferSpeedColumn(), rp.TimeRemainingColumn(), transient=True)
            self._task = self._bar.add_task("read", total=total)
            self._bar.start()

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
        elif self.enabled and time.perf_counter() - self.last >= PLAIN_PROGRESS_SECONDS:
            self.last = time.perf_counter()
            rate = self.done / MB / (self.last - self.start)
            print(f"preprocess: {self.done / MB:,.1f} / {self.total / MB:,.1f} MB read "
                  f"({100 * self.done / max(self.total, 1):.0f}%), {rate:.2f} MB/s", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def preprocess(inputs: str | Path | Sequence[str | Path], tokenizer: str | Path | Tokenizer | None,
               output_prefix: str | Path, *, workers: int = 1, json_key: str = "text", append_eod: bool = True,
               progress: bool = True) -> PreprocessStats:
    """Tokenize ``inputs`` into the indexed dataset ``output_prefix.bin`` + ``output_prefix.idx``.

    ``inputs``: file paths or globs (each glob's matches in sorted order). A ``.jsonl`` or ``.json``
    file holds one document per line, a JSON object whose ``json_key`` field is the text (as
    Megatron's preprocess_data.py reads it; blank lines are skipped); any other file is UTF-8 text
    and is one document as a whole. ``tokenizer``: a :func:`~meshtron.data.tokenizers.load_tokenizer`
    spec (``bytes``, a ``tokenizer.json``, a SentencePiece ``.model``) or a loaded tokenizer.
    ``workers``: tokenizing processes (1: this process, where a Hugging Face tokenizer may use
    several threads; more: spawned workers of one tokenizing thread each); each loads the tokenizer
    once, and the documents are written in input order whatever the count. ``append_eod``: end each non-empty
    document with the tokenizer's end-of-document id (if it has one). ``progress``: a progress bar
    on a terminal (plain lines otherwise) and the summary line; False prints nothing.

    Beside the Megatron files (unchanged from Megatron's format), ``PREFIX.meta.json`` records the
    tokenizer (:func:`dataset_meta`): a run checks its own tokenizer against it. The files are written
    under temporary names and put in place together at the end. A bad input (no file for a glob, a
    line that is not JSON or lacks the field, text that is not UTF-8, no text at all) is one
    :class:`ConfigError` naming the file (and line) and the fix, and leaves no output: files already
    at ``output_prefix`` stay as they were.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers: must be a positive integer, got {workers!r}")
    files = expand_inputs(inputs)
    spec = _tokenizer_spec(tokenizer)
    loaded = tokenizer if tokenizer is not None and not isinstance(tokenizer, str | Path) else load_tokenizer(spec)
    dtype = best_dtype(loaded.vocab_size)
    prefix = strip_suffix(output_prefix)
    init_args = (spec, json_key, append_eod, dtype.name)
    meter = _Progress(sum(f.stat().st_size for f in files), progress)
    start = time.perf_counter()
    documents = tokens = 0
    pool = None
    try:
        with WrittenTogether() as out:
            writer = out.dataset(prefix, dtype)
            if workers == 1:
                _init_worker(*init_args)
                results = map(_encode_batch, _batches(files, meter))
            else:
                pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _init_worker,
                                           (*init_args, True))
                results = _ordered(pool, _batches(files, meter), in_flight=2 * workers)
            for flat, lengths in results:
                writer.add_documents(flat, lengths)
                documents += len(lengths)
                tokens += len(flat)
            refuse_empty(files, documents, tokens)
            out.text(meta_path(prefix), dataset_meta(loaded, documents, tokens, append_eod=append_eod))
    finally:
        meter.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        _worker.clear()
    stats = PreprocessStats(prefix, len(files), documents, tokens, meter.done, time.perf_counter() - start,
                            dtype.name, workers)
    if progress:
        print(stats.summary(), flush=True)
    return stats


def _ordered(pool: ProcessPoolExecutor, batches: Iterator, in_flight: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``pool``'s results in submission order, at most ``in_flight`` batches read ahead."""
    pending: deque = deque()

    def result():
        try:
            return pending.popleft().result()
        except BrokenProcessPool as err:
            raise ConfigError(f"--workers: a tokenizing worker process died ({err}); run with --workers 1 to see "
                              "why") from None

    for batch in batches:
        pending.append(pool.submit(_encode_batch, batch))
        if len(pending) >= in_flight:
            yield result()
    while pending:
        yield result()
