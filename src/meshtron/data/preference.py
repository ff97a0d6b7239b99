"""Preference data for direct preference optimisation: a prompt with a chosen and a rejected answer,
rendered with the chat template of supervised fine-tuning, written as an indexed dataset of pairs, and
served one pair a sample, or several packed into one window pair (``data.pairs_per_window``).

**Input.** JSON lines, one pair each: ``{"prompt": ..., "chosen": ..., "rejected": ...}``. The prompt is
a string (one user turn) or a list of chat messages (``{"role": "system" | "user" | "assistant",
"content": ...}``, the conversation before the answer); each answer is a string or a list of assistant
messages (TRL's conversational form, ``[{"role": "assistant", "content": ...}]``).

**Rendering** (:func:`render_pair`): the prompt with :class:`~meshtron.data.sft.ChatTemplate` and its loss
mask set to 0 everywhere (an assistant turn inside the prompt is context, not the answer), then each
answer rendered on its own and appended: the mask is 1 on the answer and its ``<END>`` alone. Pieces are
tokenized on their own, so ``prompt + answer`` is exactly what ``--sft`` renders for the conversation.

**On disk** (:func:`preprocess_preference`): as ``--sft`` writes, ``PREFIX.bin``/``.idx`` (tokens) and
``PREFIX.loss_mask.bin``/``.idx``, with two documents per pair, the chosen conversation then the rejected
one; ``PREFIX.meta.json`` records the tokenizer and ``"preference": true``. Everything is written under
temporary names and put in place together: a bad line leaves the files at ``PREFIX`` as they were.

**Samples** (:class:`PreferencePairs`): sample ``i`` is one pair, ``[2, seq_len + 1, 3]`` (chosen then
rejected; token, segment, loss mask: each answer one document of its own window, padding after it), in
an order shuffled every epoch. A batch of ``B`` samples is ``B`` pairs, which the train step lays side by
side on the batch axis (``[2B, seq_len + 1, 3]``, chosen and rejected adjacent), so that a pair never
straddles two microbatches or two data shards.

**Packed pairs** (``data.pairs_per_window`` = ``K`` > 1, :class:`PackedPairs`): sample ``i`` is a window
pair ``[2, seq_len + 1, 3]`` holding up to ``K`` pairs: the first row their chosen conversations end to
end, the second their rejected ones in the same order, pair ``j`` of the window the document with segment
id ``j + 1`` in both rows (so its chosen and rejected answers stay in one row pair, one microbatch and one
data shard). Each epoch's pairs, shuffled as above, are packed greedily in that order: a pair joins the
window pair while both its conversations fit in their rows and fewer than ``K`` pairs are there, else it
starts the next one (a pair longer than the window is cut to it and sits alone). ``train.batch_size`` then
counts window pairs (sequences, as packed data counts them), and an epoch is as many window pairs as its
packing makes; all of it depends only on ``(seed, seq_len, K, split, holdout_fraction, the data)``, so a
resumed run reads the same windows.

**A precomputed reference** (``train.dpo.precompute_reference``): once :attr:`PreferencePairs.reference`
holds each pair's reference log-probabilities (chosen, rejected), samples carry a fourth channel, the
row's value as fp32 bits on every position (packed: each position its own conversation's value;
:mod:`meshtron.models.documents`). It is keyed by pair, so packing leaves it as it is.
"""

from __future__ import annotations

import json
import operator
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshtron.data.indexed import (
    IndexedDataset,
    WrittenTogether,
    best_dtype,
    meta_path,
    read_meta,
    strip_suffix,
)
from meshtron.data.packed_windows import PackedWindows
from meshtron.data.preprocess import PreprocessStats, dataset_meta, expand_inputs, refuse_empty
from meshtron.data.samples import SPLITS, split_range
from meshtron.data.sft import ROLES, ChatTemplate, answer_starts, json_records, mask_prefix
from meshtron.data.tokenizers import Tokenizer, load_tokenizer
from meshtron.errors import ConfigError

ANSWERS = ("chosen", "rejected")


def is_preference(prefix: str | Path) -> bool:
    """Whether the indexed dataset ``prefix`` holds preference pairs (its metadata says so)."""
    try:
        meta = read_meta(IndexedDataset(prefix))
    except (ConfigError, OSError):
        return False
    return bool(meta and meta.get("preference"))


def _messages(value: object, where: str, field: str, *, answer: bool) -> list[dict]:
    """``value`` (a string or a list of chat messages) as messages; one line naming the field otherwise."""
    if isinstance(value, str):
        if answer and not value.strip():
            raise ConfigError(f"--input: {where}: '{field}' is empty, so the pair compares nothing; write the answer "
                              "or drop the line")
        return [{"role": "assistant" if answer else "user", "content": value}]
    form = ("a string or a list of {\"role\": \"assistant\", \"content\": a string} objects" if answer else
            f"a string or a non-empty list of {{\"role\": one of {', '.join(ROLES)}, \"content\": a string}} objects")
    if not isinstance(value, list) or not value:
        raise ConfigError(f"--input: {where}: '{field}' must be {form}, got {json.dumps(value)[:80]}")
    for k, message in enumerate(value):
        roles = ("assistant",) if answer else ROLES
        if not isinstance(message, dict) or message.get("role") not in roles or not isinstance(
                message.get("content"), str):
            raise ConfigError(f"--input: {where}: '{field}'[{k}] must be {{\"role\": one of {', '.join(roles)}, "
                              f"\"content\": a string}}, got {json.dumps(message)[:80]}")
    if answer and not any(m["content"].strip() for m in value):
        raise ConfigError(f"--input: {where}: '{field}' is empty, so the pair compares nothing; write the answer or "
                          "drop the line")
    return value


def pair_of(record: object, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """``(prompt, chosen, rejected)`` messages of one JSON line; one line naming ``where``, the field and the
    fix otherwise."""
    if not isinstance(record, dict):
        raise ConfigError(f"--input: {where} is a JSON {type(record).__name__}, not an object; write one "
                          "{\"prompt\": ..., \"chosen\": ..., \"rejected\": ...} object per line")
    missing = [k for k in ("prompt", *ANSWERS) if k not in record]
    if missing:
        keys = ", ".join(map(str, record)) or "no fields"
        raise ConfigError(f"--input: {where} has no {', '.join(repr(k) for k in missing)} ({keys}); write one "
                          "{\"prompt\": ..., \"chosen\": ..., \"rejected\": ...} object per line")
    prompt = _messages(record["prompt"], where, "prompt", answer=False)
    return prompt, *(_messages(record[k], where, k, answer=True) for k in ANSWERS)


def render_pair(template: ChatTemplate, prompt: Sequence[dict], chosen: Sequence[dict],
                rejected: Sequence[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(ids, mask)]`` of the chosen conversation then the rejected one (module doc)."""
    head, _ = template.render(prompt)
    out = []
    for answer in (chosen, rejected):
        ids, mask = template.render(answer)
        out.append((np.concatenate([head, ids]), np.concatenate([np.zeros(len(head), np.uint8), mask])))
    return out


def preprocess_preference(inputs: str | Path | Sequence[str | Path], tokenizer: str | Path | Tokenizer | None,
                          output_prefix: str | Path, *, append_eod: bool = True,
                          progress: bool = True) -> PreprocessStats:
    """JSON lines of pairs (module doc) -> ``PREFIX.bin``/``.idx``, ``PREFIX.loss_mask.bin``/``.idx`` and
    ``PREFIX.meta.json``, put in place together at the end. A bad line, or an input with no pair, is one
    :class:`ConfigError` naming the file, line, field and fix, and leaves the files at ``output_prefix`` as
    they were. ``append_eod=False``: answers are not followed by ``<END>``."""
    files = expand_inputs(inputs)
    loaded = load_tokenizer(tokenizer or "bytes") if tokenizer is None or isinstance(tokenizer, str | Path) else tokenizer
    template = ChatTemplate(loaded, append_end=append_eod)
    prefix = strip_suffix(output_prefix)
    dtype = best_dtype(loaded.vocab_size)
    start, pairs, tokens, size = time.perf_counter(), 0, 0, 0
    with WrittenTogether() as out:
        ids_out, mask_out = out.dataset(prefix, dtype), out.dataset(mask_prefix(prefix), np.uint8)
        for path in files:
            size += path.stat().st_size
            for rendered in _pairs(path, template):
                for ids, mask in rendered:
                    ids_out.add_document(ids)
                    mask_out.add_document(mask)
                    tokens += len(ids)
                pairs += 1
        refuse_empty(files, pairs, tokens, "pairs", "write one JSON pair per line")
        meta = json.loads(dataset_meta(loaded, 2 * pairs, tokens, append_eod=append_eod, sft=True))
        out.text(meta_path(prefix), json.dumps({**meta, "preference": True}, indent=1) + "\n")
    stats = PreprocessStats(prefix, len(files), 2 * pairs, tokens, size, time.perf_counter() - start, dtype.name, 1)
    if progress:
        print(stats.summary().replace(f"{2 * pairs:,} documents", f"{pairs:,} pairs")
              + f" (+ loss mask at {mask_prefix(prefix)}.bin/.idx)")
    return stats


def _pairs(path: Path, template: ChatTemplate):
    for record, where in json_records(path, "pair"):
        yield render_pair(template, *pair_of(record, where))


class PreferencePairs:
    """Samples ``[2, seq_len + 1, 3]`` of one split of a preference dataset (module doc).

    The split is by pairs, as :class:`~meshtron.data.sft.PackedExamples` splits examples; ``sample(i)``
    depends only on ``(seed, split, holdout_fraction, the data)``: epochs, each shuffled on its own, are
    laid end to end, ``num_samples`` (default: one epoch) drawn. An answer longer than the window is cut to
    it; a pair whose chosen or rejected answer is cut away whole is refused (:meth:`check`)."""

    def __init__(self, prefix: str | Path, *, seq_len: int, seed: int, split: str = "train",
                 holdout_fraction: float = 0.1, num_samples: int | None = None):
        if split not in SPLITS:
            raise ConfigError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
        self.dataset = IndexedDataset(prefix)
        self.masks = IndexedDataset(mask_prefix(prefix))
        name = self.dataset.prefix
        if self.dataset.num_documents % 2 or self.masks.num_documents != self.dataset.num_documents:
            raise ConfigError(f"data.path: {name} is not a dataset of pairs with their loss mask; re-create it with "
                              "meshtron preprocess --preference")
        first, stop = split_range(self.dataset.num_documents // 2, holdout_fraction, split, name, "pairs")
        offsets = self.dataset.document_token_offsets()
        self._starts = offsets[2 * first : 2 * stop].reshape(-1, 2)
        self._lengths = np.diff(offsets)[2 * first : 2 * stop].reshape(-1, 2)
        self.answer_starts = answer_starts(self.masks, self._starts.reshape(-1),
                                           self._lengths.reshape(-1)).reshape(-1, 2)
        self.seq_len, self.seed, self.split = int(seq_len), int(seed), split
        self.num_samples = len(self._starts) if num_samples is None else int(num_samples)
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))  # the last epoch's shuffled pairs
        self.reference: np.ndarray | None = None  # [num_pairs, 2] fp32, once computed (module doc)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_pairs(self) -> int:
        return len(self._starts)

    def check(self, field: str = "data.path") -> None:
        """Refuse a split with a pair whose answer lies wholly past ``seq_len`` (its log-probability would be
        a sum over nothing, and the pair would compare prompts, not answers)."""
        lost = np.flatnonzero(np.any(self.answer_starts > self.seq_len, axis=1))
        if len(lost):
            need = int(np.max(self.answer_starts[self.answer_starts < np.iinfo(np.int64).max], initial=0))
            raise ConfigError(f"{field}: {len(lost)} of the {self.num_pairs} {self.split} pairs of "
                              f"{self.dataset.prefix} lose an answer at model.seq_len={self.seq_len} (cut before its "
                              f"first counted token); use model.seq_len={need} or more, or shorter prompts")

    def sample(self, index: int) -> np.ndarray:
        index = operator.index(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        epoch, within = divmod(index, self.num_pairs)
        if self._order[0] != epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[self.split], epoch]))
            self._order = (epoch, rng.permutation(self.num_pairs))
        return self.pair(int(self._order[1][within]))

    def pair(self, pair: int) -> np.ndarray:
        """The windows of pair ``pair`` of the split (in the dataset's order), as :meth:`sample` gives them."""
        channels = 3 if self.reference is None else 4
        out = np.zeros((2, self.seq_len + 1, channels), np.int32)
        for k in range(2):
            start, length = int(self._starts[pair, k]), min(int(self._lengths[pair, k]), self.seq_len + 1)
            out[k, :length, 0] = self.dataset.read(start, length)
            out[k, :length, 1] = 1
            out[k, :length, 2] = self.masks.read(start, length)
        if self.reference is not None:
            out[:, :, 3] = self.reference[pair].astype(np.float32).view(np.int32)[:, None]
        return out


class PackedPairs(PreferencePairs):
    """Window pairs ``[2, seq_len + 1, 3]`` of up to ``pairs_per_window`` preference pairs each, packed as
    the module doc says; :meth:`pair` (what the reference pass reads) still gives one pair's windows.
    ``num_samples`` (default: the first epoch's window pairs) is how many the run draws."""

    def __init__(self, prefix: str | Path, *, seq_len: int, seed: int, split: str = "train",
                 holdout_fraction: float = 0.1, num_samples: int | None = None, pairs_per_window: int = 2):
        super().__init__(prefix, seq_len=seq_len, seed=seed, split=split, holdout_fraction=holdout_fraction,
                         num_samples=0)
        if pairs_per_window < 1:
            raise ConfigError(f"data.pairs_per_window: must be >= 1, got {pairs_per_window}")
        self.pairs_per_window = int(pairs_per_window)
        self._fits = np.minimum(self._lengths, self.seq_len + 1)  # [pairs, 2]: each conversation as a window holds it
        self._windows = PackedWindows(self.num_pairs, self.seed, split, self._window_starts)
        self.samples_per_epoch = self._windows.per_epoch
        self.num_samples = self.samples_per_epoch if num_samples is None else int(num_samples)

    def _window_starts(self, order: np.ndarray) -> list[int]:
        """Where in ``order`` a new window pair starts: at each pair either conversation of which the
        windows so far have no room for, or once ``pairs_per_window`` pairs are held."""
        starts, chosen, rejected, held, room = [], 0, 0, 0, self.seq_len + 1
        for k, (c, r) in enumerate(self._fits[order].tolist()):
            if held == self.pairs_per_window or chosen + c > room or rejected + r > room:
                starts.append(k)
                chosen, rejected, held = 0, 0, 0
            chosen, rejected, held = chosen + c, rejected + r, held + 1
        return starts

    def window_pairs(self, index: int) -> np.ndarray:
        """The pairs (indices in the split) that sample ``index`` holds, in the order it holds them."""
        return self._windows.items(operator.index(index))

    def sample(self, index: int) -> np.ndarray:
        index = operator.index(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        channels = 3 if self.reference is None else 4
        out = np.zeros((2, self.seq_len + 1, channels), np.int32)
        filled = [0, 0]
        for segment, pair in enumerate(self.window_pairs(index).tolist(), 1):
            for k in range(2):
                start, length, at = int(self._starts[pair, k]), int(self._fits[pair, k]), filled[k]
                out[k, at : at + length, 0] = self.dataset.read(start, length)
                out[k, at : at + length, 1] = segment
                out[k, at : at + length, 2] = self.masks.read(start, length)
                if self.reference is not None:
                    out[k, at : at + length, 3] = self.reference[pair, k : k + 1].astype(np.float32).view(np.int32)
                filled[k] += length
        return out
