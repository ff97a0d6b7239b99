"""Supervised fine-tuning data: prompt/response pairs or chat conversations, rendered with a chat
template into tokens and a loss mask (the responses alone count), written as an indexed dataset, and
served as windows of whole examples packed end to end.

**Input.** JSON lines, one example each, either ``{"prompt": ..., "response": ...}`` or
``{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}`` (the OpenAI /
Hugging Face chat form).

**The template** (:data:`TEMPLATE`), the same for every tokenizer::

    <|system|>\\n{content}\\n       (optional, not counted)
    <|user|>\\n{content}\\n         (not counted)
    <|assistant|>\\n               (not counted)
    {content}<END>                 (counted: the model learns to answer, and to stop)

``<END>`` is the tokenizer's end-of-document id when it has one (``</s>``, ``<|endoftext|>``, ...),
else the text ``<|end|>`` (the byte tokenizer). Each piece is tokenized on its own, so the mask's
edges fall between tokens; :meth:`ChatTemplate.prompt` renders a conversation up to the answer's
header for generation and :meth:`ChatTemplate.answer` cuts a generated continuation at ``<END>``.

**On disk** (:func:`preprocess_sft`): the tokens are a Megatron-LM indexed dataset ``PREFIX.bin`` /
``PREFIX.idx``, one document per example (readable by any tool that reads those), and the loss mask
is a second one, ``PREFIX.loss_mask.bin`` / ``.idx``, of uint8 with the same document lengths;
``PREFIX.meta.json`` records the tokenizer (:func:`meshtron.data.preprocess.dataset_meta`). An
example with no answer (none, or only empty ones) is refused, so every example has a counted token.

**Windows** (:class:`PackedExamples`): every epoch shuffles the examples and packs them whole, in that
order, into windows of ``seq_len + 1`` tokens (a window closes when the next example does not fit; the
rest is padding), each example its own document of the window: attention, positions and the loss
stay inside it (:mod:`meshtron.models.documents`). An example longer than a window is cut to it,
and may lose its answer with the cut: :func:`check_answers` refuses a run where every training
example does, and warns when some do.
"""

from __future__ import annotations

import json
import operator
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtron.data import indexed
from meshtron.data.indexed import IndexedDataset, WrittenTogether, best_dtype, meta_path, strip_suffix
from meshtron.data.packed_windows import PackedWindows
from meshtron.data.preprocess import PreprocessStats, dataset_meta, expand_inputs, refuse_empty
from meshtron.data.samples import SPLITS, split_range
from meshtron.data.tokenizers import Tokenizer, load_tokenizer
from meshtron.errors import ConfigError

MASK_SUFFIX = ".loss_mask"
ROLES = ("system", "user", "assistant")
END_TEXT = "<|end|>"
NO_ANSWER = np.iinfo(np.int64).max  # answer_starts of an example with no counted target at all
_ANSWER_READ = 1 << 24  # mask bytes read at a time by answer_starts


def mask_prefix(prefix: str | Path) -> str:
    """Where an SFT dataset's loss mask lives: ``PREFIX.loss_mask`` (``.bin`` / ``.idx``)."""
    return strip_suffix(prefix) + MASK_SUFFIX


def has_loss_mask(prefix: str | Path) -> bool:
    """Whether the indexed dataset ``prefix`` is supervised fine-tuning data (it has a loss mask)."""
    return indexed.exists(mask_prefix(prefix))


@dataclass(frozen=True)
class ChatTemplate:
    """meshtron's chat template (module doc) for ``tokenizer``. ``append_end=False`` renders answers
    without ``<END>`` (``preprocess --sft --no-eod``): the model then never learns to stop."""

    tokenizer: Tokenizer
    append_end: bool = True

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text)) if text else []

    @property
    def end(self) -> list[int]:
        """The ids that end an answer: the tokenizer's end-of-document id, else ``<|end|>``'s."""
        eod = getattr(self.tokenizer, "eod", None)
        return [eod] if eod is not None else self._ids(END_TEXT)

    def render(self, messages: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of a conversation: ``mask`` is 1 on the assistant's answers and their ends."""
        ids: list[int] = []
        mask: list[int] = []
        for message in messages:
            role, content = message["role"], message["content"]
            header = self._ids(f"<|{role}|>\n")
            if role == "assistant":
                answer = self._ids(content) + (self.end if self.append_end else [])
                ids += header + answer
                mask += [0] * len(header) + [1] * len(answer)
            else:
                turn = header + self._ids(f"{content}\n")
                ids += turn
                mask += [0] * len(turn)
        return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)

    def prompt(self, messages: Sequence[dict] | str) -> list[int]:
        """The ids a model continues to answer: ``messages`` (or one user prompt) and the answer's header."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return [int(i) for i in self.render(messages)[0]] + self._ids("<|assistant|>\n")

    def answer(self, ids: Sequence[int]) -> str:
        """A generated continuation's answer: its text up to ``<END>`` (all of it when there is none)."""
        ids = list(ids)
        end = self.end
        for start in range(len(ids) - len(end) + 1):
            if ids[start : start + len(end)] == end:
                ids = ids[:start]
                break
        return self.tokenizer.decode(ids)


def messages_of(record: object, where: str) -> list[dict]:
    """The conversation of one JSON example (module doc); one line naming ``where`` and the fix otherwise."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"--input: {where}: 'messages' must be a non-empty list of {{role, content}} objects")
        for k, message in enumerate(messages):
            if (not isinstance(message, dict) or message.get("role") not in ROLES
                    or not isinstance(message.get("content"), str)):
                raise ConfigError(f"--input: {where}: messages[{k}] must be {{\"role\": one of {', '.join(ROLES)}, "
                                  f"\"content\": a string}}, got {json.dumps(message)[:80]}")
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        if not answers:
            raise ConfigError(f"--input: {where}: no assistant message, so nothing to learn; add the answer")
        if not any(a.strip() for a in answers):
            raise ConfigError(f"--input: {where}: the assistant message's content is empty, so there is no answer to "
                              "learn; write the answer or drop the line")
        return messages
    if isinstance(record, dict) and "prompt" in record and "response" in record:
        if not isinstance(record["prompt"], str) or not isinstance(record["response"], str):
            raise ConfigError(f"--input: {where}: 'prompt' and 'response' must be strings")
        if not record["response"].strip():
            raise ConfigError(f"--input: {where}: 'response' is empty, so there is no answer to learn; write the "
                              "answer or drop the line")
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    keys = ", ".join(map(str, record)) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
    raise ConfigError(f"--input: {where} has neither 'messages' nor 'prompt' and 'response' ({keys or 'no fields'}); "
                      "write one {\"prompt\": ..., \"response\": ...} or {\"messages\": [...]} object per line")


def preprocess_sft(inputs: str | Path | Sequence[str | Path], tokenizer: str | Path | Tokenizer | None,
                   output_prefix: str | Path, *, append_eod: bool = True, progress: bool = True) -> PreprocessStats:
    """JSON lines of examples (module doc) -> ``PREFIX.bin``/``.idx`` (tokens),
    ``PREFIX.loss_mask.bin``/``.idx`` (the mask) and ``PREFIX.meta.json`` (the tokenizer,
    :func:`~meshtron.data.preprocess.dataset_meta`), all written under temporary names and put in
    place together at the end. A bad line, or an input with no example, is one :class:`ConfigError`
    naming the file (and line) and the fix, and leaves the files at ``output_prefix`` as they were.

    ``append_eod=False`` (``--no-eod``): answers are not followed by ``<END>``, so the model does not
    learn to stop (generation then runs to its token limit)."""
    files = expand_inputs(inputs)
    loaded = load_tokenizer(tokenizer or "bytes") if tokenizer is None or isinstance(tokenizer, str | Path) else tokenizer
    template = ChatTemplate(loaded, append_end=append_eod)
    prefix = strip_suffix(output_prefix)
    dtype = best_dtype(loaded.vocab_size)
    start, examples, tokens, size = time.perf_counter(), 0, 0, 0
    with WrittenTogether() as out:
        ids_out, mask_out = out.dataset(prefix, dtype), out.dataset(mask_prefix(prefix), np.uint8)
        for path in files:
            size += path.stat().st_size
            for ids, mask in _rendered(path, template):
                ids_out.add_document(ids)
                mask_out.add_document(mask)
                examples, tokens = examples + 1, tokens + len(ids)
        refuse_empty(files, examples, tokens, "examples", "write one JSON example per line")
        out.text(meta_path(prefix), dataset_meta(loaded, examples, tokens, append_eod=append_eod, sft=True))
    stats = PreprocessStats(prefix, len(files), examples, tokens, size, time.perf_counter() - start, dtype.name, 1)
    if progress:
        print(stats.summary().replace("documents", "examples") + f" (+ loss mask at {mask_prefix(prefix)}.bin/.idx)")
    return stats


def _rendered(path: Path, template: ChatTemplate):
    """``(ids, mask)`` of each example in the JSON lines file ``path`` (blank lines skipped)."""
    for record, where in json_records(path, "example"):
        yield template.render(messages_of(record, where))


def json_records(path: Path, item: str):
    """``(record, "path:line")`` of each line of the JSON lines file ``path`` (blank lines skipped); a line
    that is not a UTF-8 JSON value is one line naming it and one ``item`` per line as the fix."""
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{line}"
            try:
                yield json.loads(raw.decode("utf-8")), where
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ConfigError(f"--input: {where} is not a UTF-8 JSON object ({err}); write one {item} "
                                  "per line") from None


class PackedExamples:
    """Windows ``[seq_len + 1, 3]`` (token, segment, loss mask) of whole examples of one split of an
    SFT dataset, packed end to end (module doc).

    The split is by examples, as :class:`~meshtron.data.samples.TokenWindows` splits documents.
    ``sample(i)`` depends only on ``(seed, seq_len, split, holdout_fraction, the data)``: epoch after
    epoch, each shuffled on its own, are laid end to end; ``num_samples`` (default: the first
    epoch's windows) is how many the run draws.
    """

    def __init__(self, prefix: str | Path, *, seq_len: int, seed: int, split: str = "train",
                 holdout_fraction: float = 0.1, num_samples: int | None = None):
        if split not in SPLITS:
            raise ConfigError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
        self.dataset = IndexedDataset(prefix)
        self.masks = IndexedDataset(mask_prefix(prefix))
        name = self.dataset.prefix
        n = self.dataset.num_documents
        if self.masks.num_documents != n or self.masks.total_tokens != self.dataset.total_tokens:
            raise ConfigError(f"data.path: {name}'s loss mask does not match its tokens ({self.masks.num_documents} vs "
                              f"{n} examples); re-create both with meshtron preprocess --sft")
        first, stop = split_range(n, holdout_fraction, split, name, "examples")
        offsets = self.dataset.document_token_offsets()[first : stop + 1]
        lengths = np.diff(offsets)
        keep = lengths > 1  # an example needs two tokens to predict anything
        self._starts, self._lengths = offsets[:-1][keep], np.minimum(lengths[keep], seq_len + 1)
        if not len(self._lengths):
            raise ConfigError(f"data.path: the {split} split of {name!r} has no example of two tokens or more")
        self.answer_starts = answer_starts(self.masks, self._starts, lengths[keep])
        self.seq_len, self.seed, self.split = int(seq_len), int(seed), split
        self._windows = PackedWindows(len(self._lengths), self.seed, split, self._window_starts)
        self.samples_per_epoch = self._windows.per_epoch
        self.num_samples = self.samples_per_epoch if num_samples is None else int(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_examples(self) -> int:
        """Examples of this split (of two tokens or more)."""
        return len(self._lengths)

    @property
    def answers_lost(self) -> int:
        """Examples of this split that train on nothing at this ``seq_len``: cut to ``seq_len + 1``
        tokens before their first counted target (:func:`answer_starts`)."""
        return int(np.count_nonzero(self.answer_starts > self.seq_len))

    def __repr__(self) -> str:
        return (f"PackedExamples({self.dataset.prefix!r}, split={self.split}, seq_len={self.seq_len}: "
                f"{self.num_samples} samples, {self.samples_per_epoch} in the first epoch)")

    def _window_starts(self, order: np.ndarray) -> list[int]:
        """Where in ``order`` a new window starts: at each example the window so far has no room for."""
        starts, fill, room = [], 0, self.seq_len + 1
        for k, length in enumerate(self._lengths[order].tolist()):
            if fill + length > room:
                starts.append(k)
                fill = 0
            fill += length
        return starts

    def sample(self, index: int) -> np.ndarray:
        index = operator.index(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        out = np.zeros((self.seq_len + 1, 3), np.int32)
        filled = 0
        for segment, example in enumerate(self._windows.items(index).tolist(), 1):
            start, length = int(self._starts[example]), int(self._lengths[example])
            out[filled : filled + length, 0] = self.dataset.read(start, length)
            out[filled : filled + length, 1] = segment
            out[filled : filled + length, 2] = self.masks.read(start, length)
            filled += length
        return out


def answer_starts(masks: IndexedDataset, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each example's first counted target: the position, within the example, of its first mask 1
    after its first token (which is never predicted); :data:`NO_ANSWER` when it has none.

    An example cut to a window of ``seq_len + 1`` tokens keeps a counted target exactly when this is
    at most ``seq_len``. ``starts`` / ``lengths``: the examples' token offsets (ascending) and whole
    lengths. The mask is read in pieces of about 16 MB with positioned reads (uint8: one byte a token),
    never memory-mapped, so a large dataset's check leaves nothing resident."""
    out = np.full(len(starts), NO_ANSWER, np.int64)
    starts = np.asarray(starts, np.int64)
    ends = starts + np.asarray(lengths, np.int64)
    first = 0
    while first < len(starts):
        stop = max(first + 1, int(np.searchsorted(ends, starts[first] + _ANSWER_READ, side="right")))
        base = int(starts[first])
        ones = np.flatnonzero(masks.read(base, int(ends[stop - 1]) - base)) + base
        ones = np.append(ones, NO_ANSWER)
        found = ones[np.searchsorted(ones, starts[first:stop] + 1)]
        inside = found < ends[first:stop]
        out[first:stop] = np.where(inside, found - starts[first:stop], NO_ANSWER)
        first = stop
    return out


def packed_datasets(samples: object) -> list[PackedExamples]:
    """The :class:`PackedExamples` among a split's samples: itself, or those of a blend."""
    if isinstance(samples, PackedExamples):
        return [samples]
    return [d for d in getattr(samples, "datasets", []) if isinstance(d, PackedExamples)]


def check_answers(samples: object, *, seq_len: int, field: str = "data.path", split: str = "train") -> None:
    """Refuse SFT training data whose every example loses its answer at ``seq_len`` (the run would
    log a loss of 0 and a gradient of 0, and learn nothing), and warn, one line on stderr, when some
    do. ``samples``: one split (:class:`PackedExamples`, or a blend holding some); ``field``: the
    setting that named the data, for the messages. The held-out split is only warned about (its loss
    would read 0 when none of its answers fits)."""
    kind = "training" if split == "train" else "held-out"
    for windows in packed_datasets(samples):
        lost, total = windows.answers_lost, windows.num_examples
        if not lost:
            continue
        answered = windows.answer_starts[windows.answer_starts != NO_ANSWER]
        keeps_all = f"model.seq_len={int(answered.max())} keeps every answer" if len(answered) else (
            "no example has a counted token")
        if lost == total and split == "train":
            raise ConfigError(
                f"{field}: every one of the {total} training examples of {windows.dataset.prefix} loses its answer at "
                f"model.seq_len={seq_len} (cut to seq_len + 1 tokens before its first counted token), so the run "
                f"would learn nothing; use a longer model.seq_len ({keeps_all}) or shorter examples")
        warn(f"{field}: {lost} of {total} {kind} examples of {windows.dataset.prefix} lose their answer at "
              f"model.seq_len={seq_len} (cut before their first counted token) and count for nothing; "
              f"{keeps_all}, or shorten those examples")


def warn(message: str) -> None:
    """One line on stderr, from the first process only."""
    import jax

    if jax.process_index() == 0:
        print(f"meshtron: {message}", file=sys.stderr, flush=True)
