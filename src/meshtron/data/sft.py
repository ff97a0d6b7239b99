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
is a second one, ``PREFIX.loss_mask.bin`` / ``.idx``, of uint8 with the same document lengths.

**Windows** (:class:`PackedExamples`): every epoch shuffles the examples and packs them whole, in that
order, into windows of ``seq_len + 1`` tokens (a window closes when the next example does not fit; the
rest is padding), each example its own document of the window: attention, positions and the loss
stay inside it (:mod:`meshtron.models.documents`). An example longer than a window is cut to it.
"""

from __future__ import annotations

import json
import operator
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtron.data import indexed
from meshtron.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype, strip_suffix
from meshtron.data.preprocess import PreprocessStats, expand_inputs
from meshtron.data.samples import SPLITS, split_range
from meshtron.data.tokenizers import Tokenizer, load_tokenizer
from meshtron.errors import ConfigError

MASK_SUFFIX = ".loss_mask"
ROLES = ("system", "user", "assistant")
END_TEXT = "<|end|>"
_CACHED_EPOCHS = 2


def mask_prefix(prefix: str | Path) -> str:
    """Where an SFT dataset's loss mask lives: ``PREFIX.loss_mask`` (``.bin`` / ``.idx``)."""
    return strip_suffix(prefix) + MASK_SUFFIX


def has_loss_mask(prefix: str | Path) -> bool:
    """Whether the indexed dataset ``prefix`` is supervised fine-tuning data (it has a loss mask)."""
    return indexed.exists(mask_prefix(prefix))


@dataclass(frozen=True)
class ChatTemplate:
    """meshtron's chat template (module doc) for ``tokenizer``."""

    tokenizer: Tokenizer

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
                answer = self._ids(content) + self.end
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
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"--input: {where}: no assistant message, so nothing to learn; add the answer")
        return messages
    if isinstance(record, dict) and "prompt" in record and "response" in record:
        if not isinstance(record["prompt"], str) or not isinstance(record["response"], str):
            raise ConfigError(f"--input: {where}: 'prompt' and 'response' must be strings")
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    keys = ", ".join(map(str, record)) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
    raise ConfigError(f"--input: {where} has neither 'messages' nor 'prompt' and 'response' ({keys or 'no fields'}); "
                      "write one {\"prompt\": ..., \"response\": ...} or {\"messages\": [...]} object per line")


def preprocess_sft(inputs: str | Path | Sequence[str | Path], tokenizer: str | Path | Tokenizer | None,
                   output_prefix: str | Path, *, progress: bool = True) -> PreprocessStats:
    """JSON lines of examples (module doc) -> ``PREFIX.bin``/``.idx`` (tokens) and
    ``PREFIX.loss_mask.bin``/``.idx`` (the mask), written under temporary names and put in place at
    the end; a bad line is one :class:`ConfigError` naming the file, the line and the fix, and leaves
    no output."""
    files = expand_inputs(inputs)
    loaded = load_tokenizer(tokenizer or "bytes") if tokenizer is None or isinstance(tokenizer, str | Path) else tokenizer
    template = ChatTemplate(loaded)
    prefix = strip_suffix(output_prefix)
    dtype = best_dtype(loaded.vocab_size)
    start, examples, tokens, size = time.perf_counter(), 0, 0, 0
    with IndexedDatasetWriter(prefix, dtype) as ids_out, IndexedDatasetWriter(mask_prefix(prefix), np.uint8) as mask_out:
        for path in files:
            size += path.stat().st_size
            with open(path, "rb") as f:
                for line, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    where = f"{path}:{line}"
                    try:
                        record = json.loads(raw.decode("utf-8"))
                    except (UnicodeDecodeError, json.JSONDecodeError) as err:
                        raise ConfigError(f"--input: {where} is not a UTF-8 JSON object ({err}); write one example "
                                          "per line") from None
                    ids, mask = template.render(messages_of(record, where))
                    ids_out.add_document(ids)
                    mask_out.add_document(mask)
                    examples, tokens = examples + 1, tokens + len(ids)
    if examples == 0:
        raise ConfigError(f"--input: {', '.join(map(str, files))} holds no example; write one JSON object per line")
    stats = PreprocessStats(prefix, len(files), examples, tokens, size, time.perf_counter() - start, dtype.name, 1)
    if progress:
        print(stats.summary().replace("documents", "examples") + f" (+ loss mask at {mask_prefix(prefix)}.bin/.idx)")
    return stats


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
        self.seq_len, self.seed, self.split = int(seq_len), int(seed), split
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._first_window = [0]  # window number each built epoch starts at (epochs are built in order)
        self.samples_per_epoch = len(self._epoch(0)[1]) - 1
        self.num_samples = self.samples_per_epoch if num_samples is None else int(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"PackedExamples({self.dataset.prefix!r}, split={self.split}, seq_len={self.seq_len}: "
                f"{self.num_samples} samples, {self.samples_per_epoch} in the first epoch)")

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order: examples in the epoch's order, bounds: window k holds ``order[bounds[k]:bounds[k+1]]``)."""
        cached = self._epochs.get(epoch)
        if cached is not None:
            return cached
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[self.split], epoch]))
        order = rng.permutation(len(self._lengths))
        bounds, fill, room = [0], 0, self.seq_len + 1
        for k, length in enumerate(self._lengths[order].tolist()):
            if fill + length > room:
                bounds.append(k)
                fill = 0
            fill += length
        bounds.append(len(order))
        self._epochs[epoch] = built = (order, np.asarray(bounds))
        while len(self._epochs) > _CACHED_EPOCHS:
            self._epochs.popitem(last=False)
        return built

    def _locate(self, index: int) -> tuple[int, int]:
        """(epoch, window within it) of sample ``index``: epochs differ in their number of windows."""
        while len(self._first_window) <= 1 or self._first_window[-1] <= index:
            epoch = len(self._first_window) - 1
            self._first_window.append(self._first_window[-1] + len(self._epoch(epoch)[1]) - 1)
        epoch = int(np.searchsorted(self._first_window, index, side="right")) - 1
        return epoch, index - self._first_window[epoch]

    def sample(self, index: int) -> np.ndarray:
        index = operator.index(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        epoch, window = self._locate(index)
        order, bounds = self._epoch(epoch)
        out = np.zeros((self.seq_len + 1, 3), np.int32)
        filled = 0
        for segment, example in enumerate(order[bounds[window] : bounds[window + 1]].tolist(), 1):
            start, length = int(self._starts[example]), int(self._lengths[example])
            out[filled : filled + length, 0] = self.dataset.read(start, length)
            out[filled : filled + length, 1] = segment
            out[filled : filled + length, 2] = self.masks.read(start, length)
            filled += length
        return out
