"""Megatron-LM indexed token datasets (``MMIDIDX``): ``PREFIX.bin`` holds the tokens, ``PREFIX.idx``
says where each sequence and document is. The index is memory-mapped, tokens are read with positioned
reads; written a document at a time.

The format, as Megatron-core's ``megatron/core/datasets/indexed_dataset.py`` writes and reads it
(little-endian throughout)::

    PREFIX.idx   9 bytes   b"MMIDIDX\\x00\\x00"             magic
                 <Q        1                              version
                 <B        dtype code of the tokens       1 uint8, 2 int8, 3 int16, 4 int32,
                                                          5 int64, 6 float64, 7 float32, 8 uint16
                 <Q        S, the number of sequences
                 <Q        D, the number of document indices (documents + 1)
                 int32[S]  sequence lengths, in tokens
                 int64[S]  sequence pointers, byte offsets into PREFIX.bin (each sequence follows
                           the one before it: pointer = sum of the earlier lengths x itemsize)
                 int64[D]  document indices: 0, then the index of the first sequence after each
                           document (document d is sequences document_indices[d]..[d+1]-1)
                (int8[S]   a "mode" per sequence, only in Megatron's multimodal datasets; the header
                           does not say so, the file is just S bytes longer: refused here)
    PREFIX.bin   the sequences' tokens back to back, in the dtype above

Megatron's ``tools/preprocess_data.py`` without ``--split-sentences`` writes one sequence per
document (its ids with the end-of-document id appended) and a document of no sequences for a text
that tokenizes to nothing; the tokens are uint16 when the tokenizer's vocabulary has fewer than
65,500 ids, else int32 (:func:`best_dtype`).

Nothing here reads the corpus into memory. The index arrays are memory maps. Token reads (``read``,
``get``, ``document``) are positioned reads (``pread``) into fresh arrays, as Megatron's
``_FileBinReader`` does: reading through a memory map instead leaves every touched page in the
process's resident set (Linux maps page-cache folios of up to 2 MB on a fault), so a process that
sampled or walked a large corpus would show the whole ``.bin`` as resident. With positioned reads the
resident size stays flat whatever the corpus size; ``tokens`` is still there, a memory-mapped view of
all of ``.bin``, for zero-copy bulk access.
"""

from __future__ import annotations

import json
import os
import struct
import weakref
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Self

import numpy as np

from meshtron.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count
DTYPE_CODES: dict[int, np.dtype] = {code: np.dtype(name) for code, name in {
    1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}.items()}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}
# Megatron's DType.optimal_dtype (what preprocess_data.py uses): uint16 below this many ids, else int32.
UINT16_VOCAB_LIMIT = 65500
_CHECK_CHUNK = 1 << 22  # elements per step of the index checks (bounded temporaries)
META_SUFFIX = ".meta.json"
META_FORMAT = "meshtron-indexed-meta"


def best_dtype(vocab_size: int | None) -> np.dtype:
    """The token dtype Megatron's preprocess_data.py picks: uint16 when the vocabulary has fewer
    than 65,500 ids (``DType.optimal_dtype``), else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT else np.int32)


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def strip_suffix(prefix: str | Path) -> str:
    """``foo.bin`` / ``foo.idx`` -> ``foo``: a prefix given with one of the two suffixes still works."""
    text = str(prefix)
    return text[:-4] if text.endswith((".bin", ".idx")) else text


def meta_path(prefix: str | Path) -> Path:
    """meshtron's metadata sidecar of the dataset ``prefix``: ``PREFIX.meta.json`` (:func:`read_meta`)."""
    return Path(f"{strip_suffix(prefix)}{META_SUFFIX}")


def exists(prefix: str | Path) -> bool:
    prefix = strip_suffix(prefix)
    return index_path(prefix).is_file() and data_path(prefix).is_file()


def _dtype_code(dtype) -> int:
    try:
        return CODE_OF_DTYPE[np.dtype(dtype)]
    except (TypeError, KeyError):
        names = ", ".join(d.name for d in DTYPE_CODES.values())
        raise ConfigError(f"indexed dataset dtype {dtype!r} is not one of Megatron's ({names})") from None


class IndexedDataset:
    """A Megatron ``MMIDIDX`` dataset at ``prefix`` (``prefix.bin`` + ``prefix.idx``), memory-mapped.

    ``sequence_lengths`` (int32), ``sequence_pointers`` (int64 byte offsets) and ``document_indices``
    (int64, ``num_documents + 1`` entries starting at 0) are read-only views of the index, as
    Megatron exposes them; ``get`` reads one sequence (or part of it) from ``.bin``, ``read`` any
    token range of the concatenated sequences, ``document`` one document (each a new array, read
    with ``pread``); ``tokens`` is all of ``.bin`` as a read-only memory map. Opening checks the header and that ``.bin`` is as
    long as the index says; any fault is one :class:`ConfigError` naming the file and the fix.
    Pickles as its prefix (a worker process maps the files again).
    """

    def __init__(self, prefix: str | Path):
        self.prefix = strip_suffix(prefix)
        self._open()

    # -- opening and checking -------------------------------------------------------------------

    def _fail(self, path: Path, problem: str, fix: str = "re-create it with meshtron preprocess") -> ConfigError:
        return ConfigError(f"indexed dataset {str(path)!r}: {problem}; {fix}")

    def _open(self) -> None:
        idx, bin_ = index_path(self.prefix), data_path(self.prefix)
        for path in (idx, bin_):
            if not path.is_file():
                problem = "does not exist" if not path.exists() else "is not a file"
                raise self._fail(path, problem, "a Megatron indexed dataset is PREFIX.bin + PREFIX.idx side by side; "
                                 "give PREFIX (without the suffix) or make one with meshtron preprocess")
        idx_size = idx.stat().st_size
        with idx.open("rb") as f:
            head = f.read(HEADER.size)
        if head[: len(MAGIC)] != MAGIC:
            if len(head) < len(MAGIC) and MAGIC.startswith(head):
                raise self._fail(idx, f"is {idx_size} bytes, shorter than the {HEADER.size}-byte header (truncated)")
            legacy = " (Megatron's old non-mmap 'TNTIDX' format, not supported)" if head.startswith(b"TNTIDX") else ""
            raise self._fail(idx, f"starts with {head[:9]!r}, not the MMIDIDX magic {MAGIC!r}{legacy}: "
                                  "not a Megatron-LM indexed dataset index")
        if len(head) < HEADER.size:
            raise self._fail(idx, f"is {idx_size} bytes, shorter than the {HEADER.size}-byte header (truncated)")
        _, version, code, count, doc_count = HEADER.unpack(head)
        if version != VERSION:
            raise self._fail(idx, f"has format version {version}; this reader knows version {VERSION} only")
        if code not in DTYPE_CODES:
            raise self._fail(idx, f"has unknown dtype code {code} (Megatron's codes are 1-8: "
                                  + ", ".join(f"{c} {d.name}" for c, d in DTYPE_CODES.items()) + ")")
        self.dtype = DTYPE_CODES[code]
        expected = HEADER.size + 12 * count + 8 * doc_count
        if idx_size == expected + count and count > 0:
            raise self._fail(idx, f"has a mode byte per sequence after its {count} sequences: a Megatron "
                                  "multimodal dataset", "meshtron reads text token datasets only")
        if idx_size != expected:
            raise self._fail(idx, f"is {idx_size} bytes but its header ({count} sequences, {doc_count} "
                                  f"document indices) needs {expected} (truncated or corrupt)")
        if doc_count < 1:
            raise self._fail(idx, "has no document indices (Megatron writes at least the leading 0)")

        def view(dtype, n: int, offset: int) -> np.ndarray:
            if n == 0:
                return np.empty(0, dtype)
            return np.memmap(idx, dtype=dtype, mode="r", offset=offset, shape=(n,))

        self.sequence_lengths = view(np.int32, count, HEADER.size)
        self.sequence_pointers = view(np.int64, count, HEADER.size + 4 * count)
        self.document_indices = view(np.int64, doc_count, HEADER.size + 12 * count)
        self.total_tokens = self._check_index(idx)
        need = self.total_tokens * self.dtype.itemsize
        have = bin_.stat().st_size
        if have != need:
            what = "truncated" if have < need else "longer than its index: .bin and .idx from different runs?"
            raise self._fail(bin_, f"has {have} bytes but {idx.name} points at {need} ({self.total_tokens} "
                                   f"{self.dtype.name} tokens; {what})",
                             "copy both files again or re-create them with meshtron preprocess")
        self.tokens = (np.memmap(bin_, dtype=self.dtype, mode="r") if need else np.empty(0, self.dtype))
        self._fd = os.open(bin_, os.O_RDONLY)
        self._closer = weakref.finalize(self, os.close, self._fd)

    def _check_index(self, idx: Path) -> int:
        """Check lengths, pointers and document indices in bounded chunks; return the token count."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        itemsize = self.dtype.itemsize
        position = 0  # bytes before the current chunk
        for start in range(0, len(lengths), _CHECK_CHUNK):
            chunk = lengths[start : start + _CHECK_CHUNK].astype(np.int64)
            if chunk.min() < 0:
                bad = start + int(np.argmax(chunk < 0))
                raise self._fail(idx, f"sequence {bad} has negative length {int(lengths[bad])} (corrupt)")
            ends = np.cumsum(chunk * itemsize) + position
            starts = np.concatenate(([position], ends[:-1]))
            if not np.array_equal(starts, pointers[start : start + _CHECK_CHUNK]):
                bad = start + int(np.argmax(starts != pointers[start : start + _CHECK_CHUNK]))
                raise self._fail(idx, f"sequence {bad} points at byte {int(pointers[bad])}, not {int(starts[bad - start])}"
                                      " right after the sequence before it (corrupt, or not written by Megatron's "
                                      "IndexedDatasetBuilder)")
            position = int(ends[-1])
        if docs[0] != 0 or docs[-1] != len(lengths):
            raise self._fail(idx, f"document indices run from {int(docs[0])} to {int(docs[-1])}, not from 0 to the "
                                  f"sequence count {len(lengths)} (corrupt)")
        for start in range(0, len(docs) - 1, _CHECK_CHUNK):
            chunk = docs[start : start + _CHECK_CHUNK + 1]
            if np.any(chunk[1:] < chunk[:-1]):
                bad = start + int(np.argmax(chunk[1:] < chunk[:-1]))
                raise self._fail(idx, f"document indices decrease after document {bad} (corrupt)")
        return position // itemsize

    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._open()

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {self.num_documents} documents, {self.num_sequences} sequences, "
                f"{self.total_tokens} {self.dtype.name} tokens)")

    # -- sizes ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of sequences (Megatron's ``len(IndexedDataset)``)."""
        return len(self.sequence_lengths)

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def document_token_offsets(self) -> np.ndarray:
        """int64 ``[num_documents + 1]``: the token offset in ``.bin`` where each document starts, then
        the total (document ``d`` is ``read(offsets[d], offsets[d+1] - offsets[d])``)."""
        docs = np.asarray(self.document_indices)
        offsets = np.empty(len(docs), np.int64)
        inner = docs < len(self.sequence_pointers)
        offsets[inner] = np.asarray(self.sequence_pointers)[docs[inner]] // self.dtype.itemsize
        offsets[~inner] = self.total_tokens
        return offsets

    # -- reading --------------------------------------------------------------------------------

    def read(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens from token offset ``start`` of the concatenated sequences, as a new array."""
        if start < 0 or count < 0 or start + count > self.total_tokens:
            raise IndexError(f"tokens [{start}, {start + count}) are outside {self.prefix}.bin's {self.total_tokens}")
        out = np.empty(count, self.dtype)
        view, offset = memoryview(out).cast("B"), start * self.dtype.itemsize
        while len(view):
            got = os.preadv(self._fd, [view], offset) if hasattr(os, "preadv") else _pread_into(self._fd, view, offset)
            if got <= 0:
                raise ConfigError(f"indexed dataset {str(data_path(self.prefix))!r}: ended at byte {offset} while "
                                  "reading (changed on disk since it was opened?); reopen the dataset")
            view, offset = view[got:], offset + got
        return out

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Sequence ``index``, or ``length`` tokens of it from token ``offset`` (Megatron's ``get``)."""
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"sequence {index} is outside {self.prefix}'s {count}")
        index %= count
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {index} of length {size}")
        return self.read(int(self.sequence_pointers[index]) // self.dtype.itemsize + offset, length)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def document(self, index: int) -> np.ndarray:
        """All tokens of document ``index`` (its sequences back to back)."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} is outside {self.prefix}'s {self.num_documents}")
        first, stop = int(self.document_indices[index]), int(self.document_indices[index + 1])
        if first == stop:
            return np.empty(0, self.dtype)
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        end = (int(self.sequence_pointers[stop]) // self.dtype.itemsize if stop < len(self) else self.total_tokens)
        return self.read(start, end - start)

    def documents(self) -> Iterator[np.ndarray]:
        """Every document in file order."""
        for d in range(self.num_documents):
            yield self.document(d)

    def close(self) -> None:
        """Close ``.bin``'s file descriptor (also done when the dataset is garbage-collected)."""
        self._closer()


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


class IndexedDatasetWriter:
    """Writes ``prefix.bin`` + ``prefix.idx`` in Megatron's format, byte for byte as Megatron-core's
    ``IndexedDatasetBuilder`` does for the same calls.

    ``add_document(ids)``: one document of one sequence (``add_document(tokens, [len(tokens)])`` in
    Megatron; an empty ``ids`` is a document of no sequences, as preprocess_data.py writes an empty
    text). ``add_sequence`` + ``end_document``: a document of several sequences. ``add_documents``:
    many one-sequence documents from one flat array. ``finalize()`` writes the index. Both files are
    written under temporary names and renamed by ``finalize``, so a failed run leaves no half
    dataset; as a context manager the writer finalizes on success and removes its files on error.
    ``finalize`` is :meth:`write_index` then :meth:`put_in_place`: :class:`WrittenTogether` runs the
    first for all its datasets before the second for any, so that several datasets replace the old
    ones only when all of them are complete. Putting a dataset in place removes a metadata sidecar
    (:func:`meta_path`) left from the files it replaces: it described those.
    """

    def __init__(self, prefix: str | Path, dtype=np.int32):
        self.prefix = strip_suffix(prefix)
        self.dtype = np.dtype(dtype)
        self._code = _dtype_code(self.dtype)
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._bin_tmp = Path(f"{self.prefix}.bin.tmp")
        self._idx_tmp = Path(f"{self.prefix}.idx.tmp")
        self._bin_tmp.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._bin_tmp.open("wb")
        self.sequence_lengths = array("i")
        self.document_indices = array("q", [0])
        self.tokens = 0
        self.finalized = False
        self._indexed = False

    def _tokens(self, ids) -> np.ndarray:
        values = np.asarray(ids)
        if values.dtype == self.dtype or values.size == 0:
            return values.astype(self.dtype, copy=False).reshape(-1)
        if self._info is not None and values.dtype.kind in "iub":
            low, high = int(values.min()), int(values.max())
            if low < self._info.min or high > self._info.max:
                bad = low if low < self._info.min else high
                raise ConfigError(f"indexed dataset {self.prefix!r}: token id {bad} does not fit its dtype "
                                  f"{self.dtype.name}; pick the dtype with best_dtype(vocab_size)")
        elif self._info is not None and values.dtype.kind not in "iub":
            raise ConfigError(f"indexed dataset {self.prefix!r}: tokens must be integers, got {values.dtype}")
        return values.astype(self.dtype).reshape(-1)

    def add_sequence(self, ids) -> None:
        """One sequence of the current document (close it with :meth:`end_document`)."""
        values = self._tokens(ids)
        self._file.write(values.tobytes(order="C"))
        self.sequence_lengths.append(values.size)
        self.tokens += values.size

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, ids) -> None:
        """A document of one sequence (of none when ``ids`` is empty)."""
        values = self._tokens(ids)
        if values.size:
            self.add_sequence(values)
        self.end_document()

    def add_documents(self, tokens, lengths) -> None:
        """Documents given as one flat token array and their lengths (0: an empty document)."""
        values = self._tokens(tokens)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != values.size or (lengths.size and lengths.min() < 0):
            raise ValueError(f"document lengths sum to {int(lengths.sum())}, not the {values.size} tokens given")
        self._file.write(values.tobytes(order="C"))
        kept = lengths[lengths > 0]
        self.sequence_lengths.extend(kept.astype(np.int32).tolist())
        self.document_indices.extend((np.cumsum(lengths > 0) + (len(self.sequence_lengths) - kept.size)).tolist())
        self.tokens += values.size

    def finalize(self) -> Path:
        """Write the index and put both files in place; returns the ``.idx`` path."""
        self.write_index()
        return self.put_in_place()

    def write_index(self) -> None:
        """Close ``.bin`` and write the index, both still under their temporary names."""
        if self.finalized or self._indexed:
            return
        self._file.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int32) if self.sequence_lengths else np.empty(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.frombuffer(self.document_indices, dtype=np.int64)
        with self._idx_tmp.open("wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, self._code, len(lengths), len(docs)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(docs.astype("<i8").tobytes())
        self._indexed = True

    def put_in_place(self) -> Path:
        """Rename the finished files (:meth:`write_index`) over ``prefix.bin`` / ``.idx``; returns the ``.idx`` path."""
        if not self.finalized:
            self.write_index()
            os.replace(self._bin_tmp, data_path(self.prefix))
            os.replace(self._idx_tmp, index_path(self.prefix))
            meta_path(self.prefix).unlink(missing_ok=True)  # it described the files just replaced
            self.finalized = True
        return index_path(self.prefix)

    def abort(self) -> None:
        """Stop and remove what was written (the temporary files)."""
        if not self._file.closed:
            self._file.close()
        for path in (self._bin_tmp, self._idx_tmp):
            path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        elif not self.finalized:
            self.abort()


def write_dataset(prefix: str | Path, documents: Iterable, dtype=np.int32) -> IndexedDataset:
    """Write one-sequence ``documents`` (token lists) at ``prefix`` and open the result."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for ids in documents:
            writer.add_document(ids)
    return IndexedDataset(prefix)


def read_meta(dataset: IndexedDataset) -> dict | None:
    """The metadata sidecar ``PREFIX.meta.json`` that ``meshtron preprocess`` writes beside the
    Megatron files (which stay exactly Megatron's format): what tokenized the dataset, and its
    document and token counts. ``None`` when there is none -- Megatron's tools and older meshtron
    write none -- or when its counts are not the dataset's (the files were replaced since, by a
    tool that does not know the sidecar), so a stale record never speaks for other tokens."""
    path = meta_path(dataset.prefix)
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ConfigError(f"indexed dataset {str(path)!r}: is not meshtron's metadata JSON ({err}); delete it or "
                          "re-create the dataset with meshtron preprocess") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        return None
    if (meta.get("documents"), meta.get("tokens")) != (dataset.num_documents, dataset.total_tokens):
        return None
    return meta


class WrittenTogether:
    """Indexed datasets and small files that replace their old versions together or not at all.

    Each is written under a temporary name (``NAME.tmp``); leaving the ``with`` block normally writes
    every index, and only when all are complete renames each file into place. An error inside the
    block -- a bad input line, an empty input found at the end, a failed write -- removes the
    temporary files and leaves whatever was at the final names byte for byte as it was. (The renames
    themselves are one ``os.replace`` each, not one atomic step.)
    """

    def __init__(self) -> None:
        self._writers: list[IndexedDatasetWriter] = []
        self._files: list[tuple[Path, Path]] = []  # (temporary, final)

    def dataset(self, prefix: str | Path, dtype=np.int32) -> IndexedDatasetWriter:
        """A writer for the dataset ``prefix``, put in place with the rest."""
        writer = IndexedDatasetWriter(prefix, dtype)
        self._writers.append(writer)
        return writer

    def text(self, path: str | Path, content: str) -> None:
        """A small text file at ``path`` (a sidecar), put in place with the rest, after the datasets."""
        final = Path(path)
        temporary = final.with_name(final.name + ".tmp")
        self._files.append((temporary, final))
        temporary.write_text(content, encoding="utf-8")

    def commit(self) -> None:
        for writer in self._writers:
            writer.write_index()
        for writer in self._writers:
            writer.put_in_place()
        for temporary, final in self._files:
            os.replace(temporary, final)

    def abort(self) -> None:
        for writer in self._writers:
            if not writer.finalized:
                writer.abort()
        for temporary, _ in self._files:
            temporary.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise
