"""lm-evaluation-harness on a meshtron checkpoint, on any mesh: the model adapter ``meshtron eval``
runs (registered with lm-eval as ``"meshtron"``), and the run that writes lm-eval's results JSON.

The adapter is a :class:`lm_eval.api.model.TemplateLM`, so contexts and continuations are split
into tokens exactly as lm-eval's Hugging Face backend splits them (the whole text encoded, the
context's tokens cut off), and it scores them the same way:

* ``loglikelihood`` / ``loglikelihood_rolling``: rows ``(context + continuation)[-(max_length + 1):]``,
  sorted longest first, ``batch_size`` per call of :meth:`meshtron.pretrained.Pretrained.scores` (a
  softmax over the real vocabulary, on the device; only two numbers per token come back), padded on
  the right to a power-of-two length so that few programs are compiled. Rolling windows are lm-eval's own
  (:func:`lm_eval.utils.get_rolling_token_windows`).
* ``generate_until``: with :class:`meshtron.batch_decode.BatchDecoder` (the KV cache where the mesh
  allows it), ``batch_size`` prompts at a time sorted by length, each left-truncated to
  ``max_length - max_gen_toks`` tokens; the text is cut at the first stop string (the task's
  ``until`` and the end-of-text token's text). The task's ``generation_kwargs`` are read as lm-eval's
  Hugging Face backend reads them (:func:`lm_eval.models.utils.normalize_gen_kwargs`, then
  temperature, top-k, top-p as ``generate`` applies them): greedy unless ``do_sample`` is not false
  and ``temperature > 0``; ``top_k`` 0 or absent and ``top_p`` 1 or absent set no limit. Any other
  key is refused in one line. Each request samples from its own seed (:func:`request_seed`: the run's
  seed, its task, document, index and copy), so its text depends neither on the batch it decodes in
  nor on the rest of the run.

The prefix token (the context of an empty context, and of a rolling window's first token) is the
tokenizer's end-of-text id, as lm-eval's backends use when a tokenizer has no BOS token.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from meshtron.batch_decode import BatchDecoder
from meshtron.errors import ConfigError
from meshtron.generate import validate_sampling
from meshtron.pretrained import Pretrained, load_pretrained
from meshtron.xla_options import run_options

SHORTEST_BUCKET = 16
DEFAULT_SEED = 1234  # lm-eval's default for the seeds after Python's (numpy, torch -- what HFLM samples with)
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def request_seed(seed: int, request: Any, repeat: int = 0) -> int:
    """The sampling seed, within ``[0, 2**31)``, of an lm-eval request (an ``Instance``) in a run seeded
    ``seed``: drawn (NumPy's ``SeedSequence``) from its task's name, its document's id, its index among
    that document's requests and ``repeat``, which copy of it this is (a task's ``repeats``). So a
    request samples the same text whatever else the run evaluates (other tasks, ``--limit``), and its
    copies sample different ones."""
    task = zlib.crc32(str(request.task_name).encode())
    doc = -1 if request.doc_id is None else int(request.doc_id)
    return int(np.random.SeedSequence([seed, task, doc + 1, int(request.idx), repeat]).generate_state(1)[0] >> 1)


def check_generation_keys(settings: dict[str, Any], where: str, fix: str) -> None:
    """One line naming the ``generation_kwargs`` keys meshtron eval does not read (``where``: the field)."""
    aliases = {"max_new_tokens", "max_tokens", "max_completion_tokens"}  # lm-eval's names for max_gen_toks
    unknown = sorted(set(map(str, settings)) - set(GENERATION_KEYS) - aliases)
    if unknown:
        raise ConfigError(f"{where}: {', '.join(unknown)} not supported by meshtron eval (it reads "
                          f"{', '.join(GENERATION_KEYS)}); remove them from {fix}")


def parse_gen_kwargs(text: str) -> dict[str, Any]:
    """lm-eval's ``--gen_kwargs`` string (``k=v,k=v``, values read as lm-eval reads them), its keys checked."""
    settings = None
    if text.strip() and all("=" in pair for pair in text.split(",")):
        try:
            settings = lm_utils.simple_parse_args_string(text)
        except (TypeError, ValueError):
            settings = None
    if not settings:
        raise ConfigError(f"--gen-kwargs: {text!r}: give key=value pairs separated by commas, e.g. "
                          "do_sample=True,temperature=0.8")
    check_generation_keys(settings, "--gen-kwargs", "--gen-kwargs")
    return settings


def generation_settings(settings: dict[str, Any], default_max_gen_toks: int, vocab_size: int) -> dict[str, Any]:
    """A task's ``generation_kwargs`` as the decoder's arguments: ``until`` (a list of strings),
    ``max_gen_toks``, ``temperature`` (0: greedy), ``top_k`` (None: no limit) and ``top_p``; read as
    lm-eval's Hugging Face backend reads them. Unsupported keys and bad values are one line."""
    from lm_eval.models.utils import normalize_gen_kwargs

    check_generation_keys(settings, "generation_kwargs", "the task's generation_kwargs")
    try:
        kwargs = dict(normalize_gen_kwargs(dict(settings), default_max_gen_toks))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"generation_kwargs {settings}: {e}; give numbers for temperature and max_gen_toks") from None
    # lm-eval reads an absent temperature as 0 (greedy), do_sample true or not (HFLM's generate too)
    temperature = float(kwargs.get("temperature", 0.0)) if kwargs["do_sample"] else 0.0
    top_k = kwargs.get("top_k") or None  # 0 or absent: no limit (as Hugging Face's generate reads 0)
    top_p = 1.0 if kwargs.get("top_p") is None else kwargs["top_p"]
    try:
        validate_sampling(vocab_size, temperature, top_k, top_p)
    except ValueError as e:
        raise ConfigError(f"generation_kwargs: {e}") from None
    until = kwargs["until"]
    if not all(isinstance(u, str) for u in until):
        raise ConfigError(f"generation_kwargs: until: expected strings, got {until!r}")
    return {"until": [u for u in until if u], "max_gen_toks": kwargs["max_gen_toks"], "temperature": temperature,
            "top_k": top_k, "top_p": float(top_p)}


def bucket(length: int, longest: int) -> int:
    """The padded length of a batch whose longest row holds ``length`` tokens: the next power of two
    (at least :data:`SHORTEST_BUCKET`), within ``longest``."""
    return min(longest, max(SHORTEST_BUCKET, 1 << math.ceil(math.log2(max(length, 1)))))


@register_model("meshtron")
class MeshtronLM(TemplateLM):
    """A meshtron checkpoint as an lm-eval model (see the module's docstring).

    ``pretrained``: what :func:`meshtron.load_pretrained` returned, or a checkpoint directory (loaded on
    its training mesh). ``batch_size``: requests per device call. ``max_gen_toks``: the default number
    of new tokens of a generation task that does not say. ``max_length``: the longest row (default: the
    model's positions). ``seed``: what sampled generation draws from (each request from its own
    :func:`request_seed`); ``None``: a fresh seed from the system's entropy, recorded in :attr:`seed`.
    """

    def __init__(self, pretrained: Pretrained | str, batch_size: int | str = 8, max_gen_toks: int = 256,
                 max_length: int | None = None, seed: int | str | None = DEFAULT_SEED, **_: Any):
        super().__init__()
        self.model = pretrained if isinstance(pretrained, Pretrained) else load_pretrained(pretrained)
        self.tokenizer = self.model.tokenizer
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size: must be >= 1, got {batch_size}")
        self.max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length or self.model.max_positions)
        if seed is not None and (not str(seed).isdigit()):
            raise ConfigError(f"seed: must be an integer >= 0 (or None for a fresh one), got {seed!r}")
        self.seed = int(np.random.SeedSequence().generate_state(1)[0] >> 1) if seed is None else int(seed)
        self._decoder: BatchDecoder | None = None

    # ---- tokens ---------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eod = self.tokenizer.eod
        return 0 if eod is None else int(eod)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "source", self.tokenizer.kind))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any) -> list[int]:
        return list(self.tokenizer.encode(string))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    # ---- scoring --------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **_: Any) -> list[tuple[float, bool]]:
        counts = [len(continuation) for _, _, continuation in requests]
        if max(counts, default=0) > self.max_length:
            raise ConfigError(f"a continuation of {max(counts)} tokens is longer than the model's {self.max_length} "
                              "positions; lm-eval scores a continuation within one window (use a shorter one)")
        rows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in requests]
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i]), rows[i]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chosen = order[start: start + self.batch_size]
            width = bucket(max(len(rows[i]) for i in chosen), self.max_length + 1)
            ids = np.zeros((self.batch_size, width), np.int32)
            for k, i in enumerate(chosen):
                ids[k, : len(rows[i])] = rows[i]
            logprobs, greedy = (np.asarray(a) for a in self.model.scores(ids))
            for k, i in enumerate(chosen):
                n, c = len(rows[i]), counts[i]
                span = slice(n - 1 - c, n - 1)  # the targets that are the continuation's tokens
                result = (float(logprobs[k, span].sum()), bool(greedy[k, span].all()))
                results[i] = result
                if requests[i][0] is not None:  # (a rolling window has no text of its own)
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation -----------------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}  # requests with the same generation settings decode together
        for index, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(index)
        results: list[str] = [""] * len(requests)
        copies: dict[tuple[Any, ...], int] = {}  # lm-eval repeats a request by passing it again
        seeds = []
        for req in requests:
            identity = (req.task_name, req.doc_id, req.idx)
            copies[identity] = copies.get(identity, -1) + 1
            seeds.append(request_seed(self.seed, req, copies[identity]))
        for indices in groups.values():
            texts = self._generate([requests[i].args[0] for i in indices], dict(requests[indices[0]].args[1]),
                                   [seeds[i] for i in indices])
            for i, text in zip(indices, texts, strict=True):
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def _generate(self, contexts: list[str], settings: dict[str, Any], seeds: list[int]) -> list[str]:
        """Continuations of ``contexts`` under one task's ``generation_kwargs``, cut at its stops; a sampled
        context ``i`` draws from ``seeds[i]``."""
        chosen_settings = generation_settings(settings, self.max_gen_toks, self.model.model_def.vocab_size)
        stops = chosen_settings["until"]
        eos = None if self.tokenizer.eod is None else self.tok_decode([self.tokenizer.eod])
        if eos and eos not in stops:
            stops.append(eos)
        new = chosen_settings["max_gen_toks"]
        if new < 1:
            raise ConfigError(f"max_gen_toks: must be >= 1, got {new}")
        if new >= self.max_length:
            raise ConfigError(f"max_gen_toks: {new} new tokens leave no room for a prompt in the model's "
                              f"{self.max_length} positions; ask for fewer")
        prompts = [self.tok_encode(c)[-(self.max_length - new):] or [self.prefix_token_id] for c in contexts]

        def cut(tokens: list[int]) -> str:
            text = self.tok_decode(tokens)
            for stop in stops:
                text = text.split(stop)[0]
            return text

        texts = [""] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        for start in range(0, len(order), self.batch_size):
            chosen = order[start: start + self.batch_size]
            outs = self.decoder().decode(self.model.params, [prompts[i] for i in chosen], new,
                                         finished=lambda _, tokens: cut(tokens) != self.tok_decode(tokens),
                                         temperature=chosen_settings["temperature"], top_k=chosen_settings["top_k"],
                                         top_p=chosen_settings["top_p"], seeds=[seeds[i] for i in chosen])
            for i, tokens in zip(chosen, outs, strict=True):
                texts[i] = cut(tokens)
        return texts

    def decoder(self) -> BatchDecoder:
        """The batched decoder of this model and mesh (compiled on first use)."""
        if self._decoder is None:
            model = self.model
            self._decoder = BatchDecoder(
                model.model_def, model.mesh, rows=self.batch_size, context=self.max_length,
                execution=model.execution,
                compiler_options=run_options(model.config.gpu.overlap, model.config.gpu.xla_flags))
        return self._decoder


def parse_seeds(value: str) -> tuple[int | None, int | None, int | None, int | None]:
    """lm-eval's ``--seed``: one integer for all four seeds (Python's ``random``, NumPy, torch -- for
    meshtron, the sampling seed -- and the few-shot sampler's), or four comma-separated values where
    ``None`` leaves that one unset (three: lm-eval's default ``1234`` is the few-shot seed)."""
    items = [v.strip() for v in value.split(",")]
    if len(items) not in (1, 3, 4) or not all(v.lower() == "none" or v.isdigit() for v in items):
        raise ConfigError(f"--seed: {value!r}: give one integer >= 0 (e.g. --seed 42) or four comma-separated "
                          "integers or None (python,numpy,sampling,fewshot, e.g. 0,None,8,52)")
    seeds = [None if v.lower() == "none" else int(v) for v in items]
    if len(seeds) == 1:
        seeds *= 4
    defaults = [0, DEFAULT_SEED, DEFAULT_SEED, DEFAULT_SEED]
    return tuple(seeds + defaults[len(seeds):])  # type: ignore[return-value]


def evaluate(model: MeshtronLM, tasks: Sequence[str], *, include_path: str | None = None, limit: float | None = None,
             num_fewshot: int | None = None, log_samples: bool = False,
             seeds: Sequence[int | None] = (0, DEFAULT_SEED, DEFAULT_SEED, DEFAULT_SEED),
             gen_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``model`` on ``tasks`` (names, or YAML tasks found under
    ``include_path``); an unknown task is one line naming it. ``seeds``: lm-eval's Python, NumPy, torch
    and few-shot seeds (:func:`parse_seeds`; the model's sampling seed is its own, :attr:`MeshtronLM.seed`).
    ``gen_kwargs``: lm-eval's ``--gen_kwargs`` (:func:`parse_gen_kwargs`), set in every generation task's
    ``generation_kwargs``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or under --include-path {include_path}" if include_path else "; give --include-path DIR for yours"
        raise ConfigError(f"--tasks: {', '.join(unknown)}: no such lm-eval task (neither built in{where})")
    python, numpy, torch, fewshot = seeds
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=log_samples, gen_kwargs=gen_kwargs or None,
                                   random_seed=python,
                                   numpy_random_seed=numpy, torch_random_seed=torch, fewshot_random_seed=fewshot)


def write_results(results: dict[str, Any], output: str | Path) -> Path:
    """``results`` as lm-eval's CLI writes them (JSON, its serializer for what JSON lacks), to a
    temporary name renamed to ``output``."""
    path = Path(output)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(results, indent=2, default=lm_utils.handle_non_serializable, ensure_ascii=False)
                       + "\n")
    os.replace(partial, path)
    return path
