"""Greedy or sampled decoding of a batch of prompts of different lengths at once, on any mesh: what
``meshtron eval`` runs for generation tasks.

:class:`~meshtron.generate.Sampler` decodes one sequence; this decodes ``rows`` of them in one
program, split over the mesh axes the ``batch`` rule names (``data``), with the tensor-parallel
layout of the weights (and, without a cache, the ``layers`` axis split over ``pipe``).

Rows share one position counter, so the cache is written with one contiguous update per step (the
model's cached attention writes all rows at the same position):

* The buffer ``[rows, context]`` holds every prompt from position 0, zeros after it. The first
  call runs the whole buffer through the model (writing the cache, if any) and reads the logits at
  the shortest prompt's last position.
* Each step moves the shared position on by one: a row still inside its prompt takes its own next
  prompt token there (teacher forcing: its cache entry is overwritten with the real token's, which
  a causal query at that position would have computed anyway), a row past its prompt chooses its
  next token: the argmax of its logits, or a draw (temperature / top-k / top-p, the rule of
  :func:`meshtron.generate.choose_token`). So every row sees exactly its own tokens at their own
  positions, and a batch of prompts sorted by length wastes few steps.
* **Sampling** is per row: row ``r`` draws its ``j``-th new token from ``fold_in(key(seeds[r]), j)``,
  the key :class:`~meshtron.generate.Sampler` uses for step ``j`` of ``seed=seeds[r]``. A row's
  tokens therefore depend only on its prompt, its seed and the settings, not on the other rows, the
  batch size or the row it lands in (up to floating-point rounding of the logits between batch
  shapes), and equal the one-sequence sampler's. Greedy calls skip the sampling work (a ``lax.cond``).
* **KV cache** (models with ``init_cache`` on a mesh with ``pipe=1``): a step is one token's forward
  pass against the cache. **Full window** otherwise: a step re-runs the whole buffer and reads the
  logits at the position (attention is causal, so the zeros after it change nothing).

No window slides: a prompt and its new tokens must fit ``context`` (the caller truncates prompts
from the left, as lm-evaluation-harness does). Steps run in chunks of a compiled ``fori_loop``;
between chunks the host asks whether every row is finished (a stop string found, or its token
budget spent), so stopping changes no program; nor do the sampling settings, which are run-time
values. Padded vocabulary ids are never chosen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.generate import CACHE_AXES, choose_token, pinned_caches, validate_sampling
from meshtron.models.attention import attention_implementation
from meshtron.models.blocks import Context
from meshtron.models.contract import final_hidden
from meshtron.sharding import axis_names, axis_rules, logical_to_spec
from meshtron.train.state import ModelDef, Params

DEFAULT_CHUNK = 16


class BatchDecoder:
    """Greedy or sampled continuations of up to ``rows`` prompts per call (see the module's docstring),
    compiled once per decoder: every call pads its prompts to ``rows`` rows of ``context`` tokens.

    ``use_cache``: ``None`` (default) decodes with a KV cache when the model has ``init_cache`` and
    the mesh has ``pipe=1``, else re-runs the full window each step; both give the same tokens.
    """

    def __init__(self, model_def: ModelDef, mesh: Mesh, *, rows: int, context: int,
                 execution: Execution = DEFAULT_EXECUTION, chunk: int = DEFAULT_CHUNK,
                 use_cache: bool | None = None, compiler_options: Mapping[str, Any] | None = None):
        if rows < 1 or chunk < 1 or context < 2:
            raise ValueError(f"rows, chunk and context: need rows >= 1, chunk >= 1, context >= 2; got {rows}, "
                             f"{chunk}, {context}")
        if model_def.max_len is not None and context > model_def.max_len:
            raise ValueError(f"context: {context} is longer than the model's {model_def.max_len} positions")
        pipe = dict(mesh.shape).get("pipe", 1)
        self.use_cache = bool(model_def.can_cache and pipe == 1 if use_cache is None else use_cache)
        self.model_def, self.mesh, self.execution, self.context, self.chunk = model_def, mesh, execution, context, chunk
        batch_axes = logical_to_spec(("batch",), model_def.rules)[0]
        split = math.prod(mesh.shape[a] for a in axis_names(batch_axes or ()))
        self.rows = -(-rows // split) * split  # whole rows per data shard
        self._rows = NamedSharding(mesh, PartitionSpec(batch_axes))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self.param_shardings = model_def.shardings(mesh)
        # one position per step cannot be split over sequence-parallel ranks: the residual stream is whole
        self._rules = tuple((name, None if name == "residual_seq" else axis) for name, axis in model_def.rules)
        self._cache_layout = all(name in {n for n, _ in self._rules} for name in CACHE_AXES)
        jit = partial(jax.jit, compiler_options=dict(compiler_options or {}) or None)
        self._start = jit(self._first_logits, donate_argnames="cache")
        self._steps = jit(self._decode_chunk, donate_argnames="cache")
        self._empty_cache = jit(self._new_cache)
        self.traces = 0  # programs traced (tests: one of each per decoder)

    def decode(self, params: Params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               finished: Callable[[int, list[int]], bool] | None = None, *, temperature: float = 0.0,
               top_k: int | None = None, top_p: float = 1.0, seeds: Sequence[int] | None = None) -> list[list[int]]:
        """Each prompt's ``max_new_tokens`` new tokens, or fewer where ``finished(row, tokens)`` said
        True after a chunk (the tokens past that point are dropped by the caller's own check).

        ``temperature`` 0 is greedy; above 0 each row samples with ``top_k`` / ``top_p``
        (:func:`meshtron.generate.sampling_logits`) from its own seed, ``seeds[r]`` (default: 0 for
        every row), as :class:`~meshtron.generate.Sampler` would with that seed."""
        if not 0 < len(prompts) <= self.rows:
            raise ValueError(f"prompts: {len(prompts)} given; pass 1 to {self.rows} per call")
        vocab_size = self.model_def.vocab_size
        validate_sampling(vocab_size, temperature, top_k, top_p)
        seeds = [0] * len(prompts) if seeds is None else [int(s) for s in seeds]
        if len(seeds) != len(prompts) or not all(0 <= s < 2**31 for s in seeds):
            raise ValueError(f"seeds: give one integer in [0, 2**31) per prompt ({len(prompts)}), got {seeds}")
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1 or max(lengths) + max_new_tokens > self.context:
            raise ValueError(f"prompts: lengths {min(lengths)}..{max(lengths)} plus {max_new_tokens} new tokens must "
                             f"fit the context of {self.context} (and be at least 1 token)")
        window = np.zeros((self.rows, self.context), np.int32)
        length = np.full(self.rows, lengths[0], np.int32)  # pad rows repeat the first prompt
        row_seeds = np.array(seeds + [seeds[0]] * (self.rows - len(prompts)), np.uint32)
        settings = [jax.device_put(v, self._replicated)
                    for v in (np.float32(temperature), np.int32(top_k or vocab_size), np.float32(top_p))]
        for row in range(self.rows):
            prompt = prompts[row] if row < len(prompts) else prompts[0]
            window[row, : len(prompt)] = prompt
            length[row] = len(prompt)
        position = min(lengths) - 1
        end = max(lengths) - 1 + max_new_tokens  # the last position any row needs
        params = jax.device_put(params, self.param_shardings)
        window_d = jax.device_put(window, self._rows)
        length_d = jax.device_put(length, self._rows)
        seeds_d = jax.device_put(row_seeds, self._rows)
        with jax.set_mesh(self.mesh), axis_rules(self._rules), attention_implementation(self.execution.attention), \
                self.model_def.adapted():
            cache = self._empty_cache(params) if self.use_cache else None
            logits, cache = self._start(params, window_d, jax.device_put(np.int32(position), self._replicated), cache)
            while position < end:
                steps = min(self.chunk, end - position)
                window_d, logits, cache = self._steps(
                    params, window_d, length_d, logits, cache, seeds_d, *settings,
                    *(jax.device_put(np.int32(v), self._replicated) for v in (position, steps)))
                position += steps
                if finished is not None and position < end:
                    held = np.asarray(jax.device_get(window_d))
                    new = [held[r, lengths[r]: min(position + 1, lengths[r] + max_new_tokens)].tolist()
                           for r in range(len(prompts))]
                    if all(len(t) >= max_new_tokens or (t and finished(r, t)) for r, t in enumerate(new)):
                        break
        held = np.asarray(jax.device_get(window_d))
        return [held[r, lengths[r]: min(position + 1, lengths[r] + max_new_tokens)].tolist()
                for r in range(len(prompts))]

    def _new_cache(self, params: Params) -> Any:
        """The model's zeroed caches for ``rows`` sequences of ``context`` positions, laid out on the mesh."""
        return self._laid_out(self.model_def.bind(params).init_cache(self.rows, self.context))

    def _laid_out(self, caches: Any) -> Any:
        return pinned_caches(caches) if self._cache_layout else caches

    def _window_logits(self, model: Any, window: jax.Array, position: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        """The whole buffer through the model (writing the cache, if any); float32 logits ``[rows, vocab]``
        at ``position``, over the real vocabulary."""
        x = final_hidden(model, window, Context.for_sequence(self.rows, self.context, 0, cache))
        x, cache = x if cache is not None else (x, None)
        last = jax.lax.dynamic_slice_in_dim(x, position, 1, axis=1)
        return self._real(model.head(last)[:, 0]), cache

    def _real(self, logits: jax.Array) -> jax.Array:
        ids = jnp.arange(logits.shape[-1])
        return jnp.where(ids < self.model_def.vocab_size, logits.astype(jnp.float32), -jnp.inf)

    def _first_logits(self, params: Params, window: jax.Array, position: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        self.traces += 1
        logits, cache = self._window_logits(self.model_def.bind(params), window, position, cache)
        return logits, None if cache is None else self._laid_out(cache)

    def _decode_chunk(self, params: Params, window: jax.Array, length: jax.Array, logits: jax.Array, cache: Any,
                      seeds: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                      position: jax.Array, steps: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
        """``steps`` (<= chunk) steps from ``position``: the new buffer, the logits at its last position
        and the cache."""
        self.traces += 1
        model = self.model_def.bind(params)
        keys = jax.vmap(jax.random.key)(seeds)
        vocab_size = self.model_def.vocab_size

        def sampled(logits, at):
            # row r's j-th new token (j = at - length[r]) uses the key Sampler uses for step j of its seed
            row_keys = jax.vmap(jax.random.fold_in)(keys, jnp.maximum(at - length, 0))
            return jax.vmap(lambda row, key: choose_token(row, key, temperature, top_k, vocab_size, top_p))(
                logits, row_keys)

        def greedy(logits, at):
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)

        def step(i, carry):
            window, logits, cache = carry
            at = position + i + 1
            own = jax.lax.dynamic_slice_in_dim(window, at, 1, axis=1)[:, 0]
            token = jnp.where(at < length, own, jax.lax.cond(temperature > 0, sampled, greedy, logits, at))
            window = jax.lax.dynamic_update_slice_in_dim(window, token[:, None], at, axis=1)
            if cache is None:
                logits, _ = self._window_logits(model, window, at, None)
            else:
                x, cache = final_hidden(model, token[:, None], Context.for_sequence(self.rows, 1, at, cache))
                logits, cache = self._real(model.head(x)[:, 0]), self._laid_out(cache)
            return window, logits, cache

        return jax.lax.fori_loop(0, steps, step, (window, logits, cache))
