"""Text generation from a trained model: greedy or temperature / top-k / top-p sampling on any mesh.

Decoding runs as one compiled program per (model, mesh), whatever the prompt, the number of new
tokens or the sampling settings:

* The context is a fixed-size token buffer of ``context`` tokens (default: the window the model
  was trained on, within its ``max_len``: a GPT's positions are learned embeddings, so it has no
  position beyond its table). When the text outgrows the buffer the window slides: the buffer keeps the last
  ``context`` tokens, which then take positions ``0 .. context - 1`` (the model was trained on
  windows that start anywhere in the text, so a window that starts mid-text is what it knows). A
  prompt longer than ``context`` likewise starts from its last ``context`` tokens.
* **KV cache** (models with ``init_cache``, on a mesh with ``pipe=1``; the default there). A cache
  of ``context`` positions per layer holds every key and value computed so far. The first step
  *prefills* it: one forward pass over the whole buffer, padded to ``context`` tokens so that one
  program serves every prompt length. The pad tokens' entries are written too but never read:
  :func:`meshtron.models.attention.causal_attention` lets a query see only the entries at
  positions ``<=`` its own, and the step at position ``p`` writes entry ``p`` before attending, so
  each pad entry is overwritten by the real token before any query can see it. Every later step
  feeds one token (the last one chosen, at its position ``length - 1``) through the model, writes
  its key/value and reads the logits: one token's work instead of a whole window's. Once the
  window is full and slides, every token sits at a new position, so the cached entries are stale:
  that step re-prefills the slid window (a ``lax.cond`` between the one-token step and the
  prefill), which keeps exactly the sliding-window semantics of the full-window path (the same
  tokens at every length, up to floating-point rounding).
* **Full window** (models without ``init_cache``, meshes with ``pipe > 1``, or
  ``use_cache=False``). Attention is causal, so the tokens after the current position never
  change the logits at the current position: every step runs the forward pass over the whole
  buffer, unused slots included, and reads the logits at the last filled position.
* Steps run in a ``lax.fori_loop`` over a fixed-size chunk of output slots; the number of steps,
  the prompt length, the temperature, top-k and top-p are run-time values, so none of them recompiles.
  Step ``i`` draws from ``fold_in(key(seed), i)``: a seed gives the same text whatever the chunk
  size, with or without the cache, and on another mesh layout too (up to floating-point rounding
  of the logits, as JAX's default random bits do not depend on sharding).

The forward pass is plain ``jax.jit`` on the parameters' own layout: the compiler handles the
tensor-sharded weights (and, on the full-window path, the pipe-sharded ``layers`` axis, inserting
the communication the layer scan needs). The single sequence is replicated over ``data``. The
cache follows the tensor split of the keys and values: it is laid out by the logical names
``(layers, batch, seq, kv_heads, head_dim)``, so its ``kv_heads`` axis splits over ``tensor``
exactly when the model's key/value heads do (replicated when there are fewer key/value heads than
tensor ranks). The cached path needs ``pipe=1``: by default a ``pipe > 1`` mesh decodes with the
full window (same tokens, slower); asking for ``use_cache=True`` there is an error that says to
sample on a mesh without pipeline stages (``meshtron generate ... parallel.pipe=1``). Padded
vocabulary ids (``>= vocab_size``) are masked out before any choice, so they can never be
produced.

Text goes through the checkpoint's tokenizer (:mod:`meshtron.data.tokenizers`: ``tokenizer=``),
bytes without one; byte decoding uses ``errors="replace"`` because sampled bytes need not form
valid UTF-8, and ids above 255 (a vocabulary larger than the byte range) decode to U+FFFD as well.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtron.data.tokenizers import Tokenizer
from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.models.attention import KVCache, attention_implementation
from meshtron.models.blocks import Context
from meshtron.models.contract import final_hidden
from meshtron.sharding import axis_rules, constrain
from meshtron.train.state import ModelDef, Params
from meshtron.xla_options import run_options

if TYPE_CHECKING:
    from meshtron.pretrained import Pretrained

DEFAULT_CHUNK = 64
CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")  # logical layout of a stacked KVCache


def pinned_caches(caches: Any) -> Any:
    """Stacked :class:`KVCache` arrays ``[layers, batch, seq, kv_heads, head_dim]`` pinned by logical names,
    so the cache's rows follow ``data`` and its head axis the keys' and values' tensor split; other caches
    (a user's model's own) are left to the compiler."""

    def pin(cache: Any) -> Any:
        if isinstance(cache, KVCache) and cache.k.ndim == len(CACHE_AXES):
            return KVCache(constrain(cache.k, CACHE_AXES), constrain(cache.v, CACHE_AXES))
        return cache

    return jax.tree.map(pin, caches, is_leaf=lambda x: isinstance(x, KVCache))
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class SampleResult:
    """A prompt and what the model wrote after it.

    ``prompt_tokens`` is the whole prompt as given (even when only its tail fitted in the context);
    ``new_tokens`` the generated ids: ``max_new_tokens`` of them (``finish_reason`` ``"length"``), or
    those before the first stop sequence (``"stop"``; the stop sequence itself is left out).
    """

    prompt_tokens: tuple[int, ...]
    new_tokens: tuple[int, ...]
    tokenizer: Tokenizer | None = None  # what decodes the ids; None: bytes
    finish_reason: str = "length"  # "stop": ended at a stop sequence (not included); "length": max_new_tokens

    @property
    def tokens(self) -> tuple[int, ...]:
        """Prompt followed by the continuation."""
        return self.prompt_tokens + self.new_tokens

    @property
    def text(self) -> str:
        """Prompt + continuation, decoded together (so a character split across the boundary survives)."""
        return self._decode(self.tokens)

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None or self.tokenizer.kind == "bytes":
            return decode_tokens(ids)
        return self.tokenizer.decode(ids)

    @property
    def continuation(self) -> str:
        """The generated part alone. It can start with U+FFFD if the model continued a character
        whose first bytes are in the prompt (possible only for a prompt given as token ids)."""
        return self._decode(self.new_tokens)


def encode_prompt(prompt: str | Sequence[int], tokenizer: Tokenizer | None = None) -> list[int]:
    """Token ids of a prompt: a string encoded by ``tokenizer`` (None: its UTF-8 bytes), or a
    sequence of ids taken as is."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if tokenizer is not None else list(prompt.encode("utf-8"))
    if isinstance(prompt, (bytes, bytearray)):
        return list(prompt)
    ids = list(prompt)
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise ValueError(f"prompt: token {i} is {t!r}, not an integer id; pass a str or a list of ints")
    return [int(t) for t in ids]


def _is_int(value: Any) -> bool:
    """A Python or NumPy integer (``True`` is not a token count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def decode_tokens(ids: Sequence[int]) -> str:
    """Byte ids -> text, never failing: invalid UTF-8 and ids outside 0..255 become U+FFFD."""
    text: list[str] = []
    run = bytearray()
    for t in ids:
        if 0 <= t < 256:
            run.append(t)
        else:  # not a byte: flush the pending bytes so the marker lands in the right place
            text.append(run.decode("utf-8", errors="replace"))
            run.clear()
            text.append(_REPLACEMENT)
    text.append(run.decode("utf-8", errors="replace"))
    return "".join(text)


def default_stops(tokenizer: Tokenizer | None) -> tuple[tuple[int, ...], ...]:
    """Where generation ends by default: the tokenizer's end-of-text id, and the end of an answer in
    meshtron's chat template (the same id, or the text ``<|end|>`` for a tokenizer without one, such as
    bytes)."""
    from meshtron.data.sft import ChatTemplate
    from meshtron.data.tokenizers import ByteTokenizer

    tokenizer = tokenizer or ByteTokenizer()
    stops = {tuple(ChatTemplate(tokenizer).end)}
    eod = getattr(tokenizer, "eod", None)
    if eod is not None:
        stops.add((int(eod),))
    return tuple(sorted(stops))


def first_stop(ids: Sequence[int], stops: Sequence[Sequence[int]]) -> int | None:
    """The index in ``ids`` where the first of the ``stops`` sequences begins, or ``None``."""
    ids = list(ids)
    starts = [start for stop in stops for start in range(len(ids) - len(stop) + 1)
              if ids[start : start + len(stop)] == list(stop)]
    return min(starts, default=None)


def _check_stops(stops: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    try:
        checked = tuple(tuple(int(t) for t in stop) for stop in stops)
    except (TypeError, ValueError):
        raise ValueError(f"stop: expected a list of token-id sequences, e.g. [[2]] (or [] to stop only at "
                         f"max_new_tokens), got {stops!r}") from None
    if any(not stop for stop in checked):
        raise ValueError("stop: a stop sequence is empty; give at least one token id in each")
    return checked


def validate_request(
    prompt_ids: Sequence[int], vocab_size: int, max_new_tokens: int, temperature: float, top_k: int | None,
    top_p: float = 1.0,
) -> None:
    """Reject impossible requests up front, naming the argument and the fix."""
    if not prompt_ids:
        raise ValueError("prompt: is empty; give at least one token (the model predicts from the last one)")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt: token ids {sorted(set(bad))[:5]} are outside the vocabulary [0, {vocab_size}); "
            f"use ids below {vocab_size} (a str prompt gives its UTF-8 bytes)"
        )
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be an integer >= 1, got {max_new_tokens!r}")
    validate_sampling(vocab_size, temperature, top_k, top_p)


def validate_sampling(vocab_size: int, temperature: float, top_k: int | None, top_p: float = 1.0) -> None:
    """Reject impossible sampling settings up front, naming the argument and the fix."""
    if not _is_number(temperature):
        raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0 (0 = greedy, e.g. 0.8 to sample), got {temperature}")
    if top_k is not None and (not _is_int(top_k) or not 1 <= top_k <= vocab_size):
        raise ValueError(
            f"top_k: must be an integer in [1, {vocab_size}] (the vocabulary size) or None for no limit, "
            f"got {top_k!r}"
        )
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be a number in (0, 1] (1 = no limit, e.g. 0.9), got {top_p!r}")


def _is_number(value: Any) -> bool:
    """A finite Python or NumPy real (``True`` is not a temperature)."""
    return (isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
            and math.isfinite(value))


def sampling_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The logits ``[..., vocab]`` a sampled token is drawn from, as Hugging Face's ``generate`` warps them
    (temperature, then top-k, then top-p): divided by ``temperature``; those below the ``top_k``-th largest
    set to ``-inf``; then only the most likely tokens whose probabilities, summed from the likeliest down,
    first reach ``top_p`` are kept (at least one). Ties at either cut are kept, so the result does not depend
    on how a sort orders equal values. ``top_k`` = vocabulary size and ``top_p`` = 1 keep everything."""
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    ordered = jnp.sort(scaled, axis=-1)[..., ::-1]  # descending
    kth_largest = jnp.take(ordered, jnp.clip(top_k - 1, 0, vocab - 1), axis=-1)[..., None]
    ordered = jnp.where(ordered >= kth_largest, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the probability of the tokens likelier than each
    kept = jnp.sum((before < top_p) & (probs > 0), axis=-1, keepdims=True)
    smallest_kept = jnp.take_along_axis(ordered, jnp.maximum(kept - 1, 0), axis=-1)
    cut = jnp.where(top_p >= 1, kth_largest, jnp.maximum(smallest_kept, kth_largest))
    return jnp.where(scaled >= cut, scaled, -jnp.inf)


def choose_token(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, vocab_size: int,
    top_p: jax.Array | float = 1.0,
) -> jax.Array:
    """One token id from logits over the padded vocabulary.

    Padded ids get ``-inf`` first, so neither argmax nor sampling can pick them. ``temperature``
    0 is greedy. Otherwise the token is drawn from :func:`sampling_logits` (``temperature``, ``top_k``,
    ``top_p``). Both paths are computed and one is selected, so greedy and sampling share one compiled
    program.
    """
    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where(ids < vocab_size, logits.astype(jnp.float32), -jnp.inf)
    greedy = jnp.argmax(logits)
    sampled = jax.random.categorical(key, sampling_logits(logits, temperature, top_k, top_p))
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def append_token(window: jax.Array, length: jax.Array, token: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Add ``token`` after the ``length`` filled slots of ``window`` [seq_len]; when full, slide by one."""
    full = length == window.shape[0]
    slid = jnp.roll(window, -1).at[-1].set(token)
    grown = window.at[jnp.minimum(length, window.shape[0] - 1)].set(token)
    return jnp.where(full, slid, grown), jnp.where(full, length, length + 1)


class Sampler:
    """The compiled decoder of one model on one mesh; reuse it to sample many times without recompiling.

    ``chunk`` is how many tokens one call of the compiled program can produce (longer requests
    call it again); it changes speed only, never the tokens. ``execution``: how the run executes the
    model (:class:`~meshtron.execution.Execution`: its attention implementation, its training window).
    ``context`` is the number of tokens the model sees (default: :meth:`Execution.context
    <meshtron.execution.Execution.context>`, the run's training window within the model's
    ``max_len``). ``use_cache``: decode with a KV cache (one
    prefill, then one token's forward pass per step) or re-run the whole window every step;
    ``None`` (default) uses the cache when the model has ``init_cache`` and the mesh has
    ``pipe=1``, ``True`` insists (an error otherwise), ``False`` never uses it. Both give the same
    tokens; :attr:`use_cache` says which one this sampler runs. ``compiler_options``: XLA options its
    programs are compiled with (the run's ``gpu`` section: :func:`meshtron.xla_options.compiler_options`).
    """

    def __init__(
        self,
        model_def: ModelDef,
        mesh: Mesh,
        *,
        execution: Execution = DEFAULT_EXECUTION,
        chunk: int = DEFAULT_CHUNK,
        context: int | None = None,
        use_cache: bool | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ):
        if chunk < 1:
            raise ValueError(f"chunk: must be >= 1, got {chunk}")
        context = context or execution.context(model_def.max_len)
        if context is None:
            raise ValueError("context: this model has no max_len and no training window is known; give the context "
                             "length (e.g. the training seq_len)")
        if model_def.max_len is not None and context > model_def.max_len:
            raise ValueError(f"context: {context} is longer than the model's {model_def.max_len} positions")
        pipe = dict(mesh.shape).get("pipe", 1)
        if use_cache is None:
            use_cache = model_def.can_cache and pipe == 1
        elif use_cache and not model_def.can_cache:
            raise ValueError(
                "use_cache: this model has no init_cache(batch, max_len), so it cannot decode with a KV cache; "
                "add one (see meshtron.models.contract) or pass use_cache=None / False to re-run the full window"
            )
        elif use_cache and pipe > 1:
            raise ValueError(
                f"use_cache: the KV cache needs a mesh with pipe=1, this one has pipe={pipe}; sample on a mesh "
                "without pipeline stages (meshtron generate ... parallel.pipe=1, e.g. with parallel.tensor= for the "
                "devices), or pass use_cache=None to fall back to re-running the full window"
            )
        self.context = context
        self.model_def = model_def
        self.execution = execution
        self.mesh = mesh
        self.chunk = chunk
        self.use_cache = bool(use_cache)
        self.param_shardings = model_def.shardings(mesh)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        # The cache is carried from one chunk to the next: donated, each call updates it in place.
        self.compiler_options = dict(compiler_options or {})
        jit = partial(jax.jit, compiler_options=self.compiler_options or None)
        self._decode = jit(self._decode_chunk, donate_argnames="cache")
        self._empty_cache = jit(self._new_cache)
        self._traces = 0  # how many times the decoding program was traced (tests: it compiles once)
        # A batch of one sequence has nothing to split over ``data`` (the constraint would pad it
        # to one row per data shard): activations keep their tensor-parallel layout but the batch
        # axis is replicated. Decoding steps hold one position, which sequence parallelism cannot
        # split: the residual stream is replicated too.
        self._rules = tuple((name, None if name in ("batch", "residual_seq") else axis)
                            for name, axis in model_def.rules)
        named = {name for name, _ in self._rules}
        self._cache_layout = all(name in named for name in CACHE_AXES)

    def sample(
        self,
        params: Params,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
        stop: Sequence[Sequence[int]] | None = None,
    ) -> SampleResult:
        """Continue ``prompt`` by up to ``max_new_tokens`` tokens, ending early at a ``stop`` sequence
        (see :func:`sample`)."""
        vocab_size = self.model_def.vocab_size
        prompt_ids = encode_prompt(prompt, tokenizer)
        validate_request(prompt_ids, vocab_size, max_new_tokens, temperature, top_k, top_p)
        stops = default_stops(tokenizer) if stop is None else _check_stops(stop)
        # Already-placed parameters stay put; host arrays (e.g. a restored checkpoint) are placed.
        params = jax.device_put(params, self.param_shardings)
        window, length = self._initial_window(prompt_ids)
        # ``fresh``: the cache holds the window's positions 0 .. length - 2 (False: prefill first).
        fresh = self._put((np.bool_(False),))[0]
        settings = self._put(
            (jax.random.key(seed), np.float32(temperature), np.int32(top_k or vocab_size), np.float32(top_p))
        )
        new: list[int] = []
        # Each chunk is one call of the compiled loop; a stop sequence is looked for between chunks (a
        # chunk's tokens after it are computed and dropped), so stopping changes no compiled program.
        with jax.set_mesh(self.mesh), axis_rules(self._rules), attention_implementation(self.execution.attention), \
                self.model_def.adapted():
            cache = self._empty_cache(params) if self.use_cache else None
            for start in range(0, max_new_tokens, self.chunk):
                steps = min(self.chunk, max_new_tokens - start)
                window, length, fresh, cache, tokens = self._decode(
                    params, window, length, fresh, cache, *settings, *self._put((np.int32(start), np.int32(steps)))
                )
                new += [int(t) for t in np.asarray(jax.device_get(tokens))[:steps]]
                end = first_stop(new, stops)
                if end is not None:
                    return SampleResult(tuple(prompt_ids), tuple(new[:end]), tokenizer, "stop")
        return SampleResult(tuple(prompt_ids), tuple(new), tokenizer)

    def _initial_window(self, prompt_ids: list[int]) -> tuple[jax.Array, jax.Array]:
        """The context buffer holding the prompt's last ``context`` tokens, zeros after them."""
        kept = prompt_ids[-self.context:]
        window = np.zeros(self.context, np.int32)
        window[: len(kept)] = kept
        return self._put((window, np.int32(len(kept))))

    def _put(self, values: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        return tuple(jax.device_put(v, self._replicated) for v in values)

    def _new_cache(self, params: Params) -> Any:
        """The model's zeroed caches for one sequence of ``context`` positions, laid out on the mesh."""
        return self._laid_out(self.model_def.bind(params).init_cache(1, self.context))

    def _laid_out(self, caches: Any) -> Any:
        return pinned_caches(caches) if self._cache_layout else caches

    def _decode_chunk(
        self,
        params: Params,
        window: jax.Array,
        length: jax.Array,
        fresh: jax.Array,
        cache: Any,
        key: jax.Array,
        temperature: jax.Array,
        top_k: jax.Array,
        top_p: jax.Array,
        start: jax.Array,
        steps: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array, Any, jax.Array]:
        """``steps`` (<= chunk) decoding steps; returns the new window, its fill, whether the cache
        is fresh, the cache (``None`` on the full-window path) and the chunk's tokens."""
        self._traces += 1
        model = self.model_def.bind(params)
        vocab_size = self.model_def.vocab_size
        context = self.context

        def window_logits(window, length, cache):
            """The whole buffer at positions 0 .. context - 1 (writing the cache, if any); the
            logits at position ``length - 1``. Only that position goes through the head."""
            ctx = Context.for_sequence(1, context, 0, cache)
            x = final_hidden(model, window[None], ctx)
            x, cache = x if cache is not None else (x, None)
            last = jax.lax.dynamic_slice_in_dim(x, length - 1, 1, axis=1)
            return model.head(last)[0, 0], cache

        def token_logits(window, length, cache):
            """One token, the last of the buffer (position ``length - 1``), against the cache."""
            ctx = Context.for_sequence(1, 1, length - 1, cache)
            token = jax.lax.dynamic_slice_in_dim(window, length - 1, 1)[None]
            x, cache = final_hidden(model, token, ctx)
            return model.head(x)[0, 0], cache

        def step(i, carry):
            window, length, fresh, cache, out = carry
            if cache is None:
                logits, _ = window_logits(window, length, None)
            else:
                logits, cache = jax.lax.cond(fresh, token_logits, window_logits, window, length, cache)
                cache = self._laid_out(cache)
            token = choose_token(logits, jax.random.fold_in(key, start + i), temperature, top_k, vocab_size, top_p)
            # Growing keeps the cache valid (it holds positions 0 .. length - 1, the new token comes
            # next); sliding moves every token to a new position, so the next step prefills again.
            fresh = length < context
            window, length = append_token(window, length, token)
            return window, length, fresh, cache, out.at[i].set(token)

        out = jnp.zeros(self.chunk, jnp.int32)
        return jax.lax.fori_loop(0, steps, step, (window, length, fresh, cache, out))


def sample(
    model: ModelDef | Pretrained,
    *args: Any,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    context: int | None = None,
    use_cache: bool | None = None,
    tokenizer: Tokenizer | None = None,
    stop: Sequence[Sequence[int]] | None = None,
    execution: Execution | None = None,
) -> SampleResult:
    """Continue a prompt with up to ``max_new_tokens`` tokens, called either way:

    * ``sample(pretrained, prompt, ...)`` with what :func:`meshtron.load_pretrained` returned: its
      parameters, mesh and tokenizer, and its recorded training window as the context;
    * ``sample(model_def, params, mesh, prompt, ...)``: ``params`` is the canonical parameter tree
      (blocks stacked ``[layers, ...]`` in layer order, as :meth:`ModelDef.init` makes them and
      checkpoints store them), ideally laid out with ``model_def.shardings(mesh)`` (anything else
      is moved there first); text is encoded by ``tokenizer``, or as UTF-8 bytes without one.

    ``prompt`` is text or a list of token ids. ``temperature`` 0 is greedy decoding; above 0 tokens
    are drawn from ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely when
    given, and then to the most likely whose probabilities first sum to ``top_p`` (below 1; see
    :func:`sampling_logits`). ``seed`` makes sampling reproducible. ``stop``: token-id sequences that end the text (left
    out of it); by default the tokenizer's end-of-text id and the chat template's end of an answer
    (:func:`default_stops`), ``[]`` to always produce ``max_new_tokens``. ``context`` and ``use_cache``: see :class:`Sampler`
    (by default a KV cache whenever the model has one and the mesh has ``pipe=1``). ``execution``: how
    the run executes the model (its attention implementation and training window; default: the
    ``Pretrained``'s, else :class:`~meshtron.execution.Execution`'s defaults). ``tokenizer``,
    ``context`` and ``execution`` override what a ``Pretrained`` carries.

    Builds and compiles a :class:`Sampler`; to sample repeatedly from one model, keep a ``Sampler``
    instead.
    """
    if isinstance(model, ModelDef):
        if len(args) != 3:
            raise TypeError(f"sample(model_def, params, mesh, prompt, ...): expected 4 positional arguments, got "
                            f"{1 + len(args)}")
        model_def, params, mesh, prompt = model, *args
        options = None
    else:
        if len(args) != 1:
            raise TypeError(f"sample(pretrained, prompt, ...): expected 2 positional arguments, got {1 + len(args)}")
        model_def, params, mesh, prompt = model.model_def, model.params, model.mesh, args[0]
        tokenizer = tokenizer or model.tokenizer
        execution = execution or model.execution
        options = run_options(model.config.gpu.overlap, model.config.gpu.xla_flags)
    return Sampler(model_def, mesh, execution=execution or DEFAULT_EXECUTION, context=context, use_cache=use_cache,
                   compiler_options=options).sample(
        params, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        tokenizer=tokenizer, stop=stop,
    )
