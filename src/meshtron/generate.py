"""Text generation from a trained GPT: greedy or temperature / top-k sampling on any mesh.

Decoding runs as one compiled program per (model, mesh), whatever the prompt, the number of new
tokens or the sampling settings:

* The context is a fixed-size token buffer of ``dims.seq_len`` tokens (the model's positions are
  learned embeddings, so it has no position beyond ``seq_len``). Attention is causal, so the
  tokens after the current position never change the logits at the current position: every step
  runs the full forward pass over the whole buffer, unused slots included, and reads the logits
  at the last filled position. No KV cache is kept; a step costs one full forward pass.
* When the text outgrows the buffer the window slides: the buffer keeps the last ``seq_len``
  tokens, which then take positions ``0 .. seq_len - 1`` (the model was trained on windows that
  start anywhere in the text, so a window that starts mid-text is what it knows). A prompt longer
  than ``seq_len`` likewise starts from its last ``seq_len`` tokens.
* Steps run in a ``lax.fori_loop`` over a fixed-size chunk of output slots; the number of steps,
  the prompt length, the temperature and top-k are run-time values, so none of them recompiles.
  Step ``i`` draws from ``fold_in(key(seed), i)``: a seed gives the same text whatever the chunk
  size, and on another mesh layout too (up to floating-point rounding of the logits, as JAX's
  default random bits do not depend on sharding).

The forward pass is plain ``jax.jit`` on the parameters' own layout: the compiler handles the
tensor-sharded weights and the pipe-sharded ``layers`` axis (inserting the communication the
layer scan needs). The single sequence is replicated over ``data``. Padded vocabulary ids
(``>= dims.vocab_size``) are masked out before any choice, so they can never be produced.

Tokens are bytes (:mod:`meshtron.data`); decoding uses ``errors="replace"`` because sampled bytes
need not form valid UTF-8, and ids above 255 (a vocabulary larger than the byte range) decode to
U+FFFD as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtron.sharding import axis_rules, current_rules
from meshtron.train.state import ModelDef, Params

DEFAULT_CHUNK = 64
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class SampleResult:
    """A prompt and what the model wrote after it.

    ``prompt_tokens`` is the whole prompt as given (even when only its tail fitted in the context);
    ``new_tokens`` the ``max_new_tokens`` generated ids.
    """

    prompt_tokens: tuple[int, ...]
    new_tokens: tuple[int, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        """Prompt followed by the continuation."""
        return self.prompt_tokens + self.new_tokens

    @property
    def text(self) -> str:
        """Prompt + continuation, decoded together (so a character split across the boundary survives)."""
        return decode_tokens(self.tokens)

    @property
    def continuation(self) -> str:
        """The generated part alone. It can start with U+FFFD if the model continued a character
        whose first bytes are in the prompt (possible only for a prompt given as token ids)."""
        return decode_tokens(self.new_tokens)


def encode_prompt(prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a prompt: a string's UTF-8 bytes, or a sequence of ids taken as is."""
    if isinstance(prompt, str):
        return list(prompt.encode("utf-8"))
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


def validate_request(
    prompt_ids: Sequence[int], vocab_size: int, max_new_tokens: int, temperature: float, top_k: int | None
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
    if not isinstance(temperature, (int, float, np.floating, np.integer)) or not math.isfinite(temperature):
        raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0 (0 = greedy, e.g. 0.8 to sample), got {temperature}")
    if top_k is not None and (not _is_int(top_k) or not 1 <= top_k <= vocab_size):
        raise ValueError(
            f"top_k: must be an integer in [1, {vocab_size}] (the vocabulary size) or None for no limit, "
            f"got {top_k!r}"
        )


def choose_token(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, vocab_size: int
) -> jax.Array:
    """One token id from logits over the padded vocabulary.

    Padded ids get ``-inf`` first, so neither argmax nor sampling can pick them. ``temperature``
    0 is greedy. Otherwise the logits outside the ``top_k`` largest (ties at the k-th value are
    kept) are dropped and the rest sampled at ``temperature``. Both paths are computed and one is
    selected, so greedy and sampling share one compiled program.
    """
    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where(ids < vocab_size, logits.astype(jnp.float32), -jnp.inf)
    greedy = jnp.argmax(logits)
    kth_largest = jnp.sort(logits)[logits.shape[-1] - top_k]
    kept = jnp.where(logits >= kth_largest, logits, -jnp.inf)
    sampled = jax.random.categorical(key, kept / jnp.maximum(temperature, 1e-6))
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
    call it again); it changes speed only, never the tokens.
    """

    def __init__(self, model_def: ModelDef, mesh: Mesh, *, chunk: int = DEFAULT_CHUNK):
        if chunk < 1:
            raise ValueError(f"chunk: must be >= 1, got {chunk}")
        self.model_def = model_def
        self.mesh = mesh
        self.chunk = chunk
        self.param_shardings = model_def.shardings(mesh)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._decode = jax.jit(self._decode_chunk)
        # A batch of one sequence has nothing to split over ``data`` (the constraint would pad it
        # to one row per data shard): activations keep their tensor-parallel layout but the batch
        # axis is replicated.
        self._rules = tuple((name, None if name == "batch" else axis) for name, axis in current_rules())

    def sample(
        self,
        params: Params,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
    ) -> SampleResult:
        """Continue ``prompt`` by ``max_new_tokens`` tokens (see :func:`sample`)."""
        dims = self.model_def.dims
        prompt_ids = encode_prompt(prompt)
        validate_request(prompt_ids, dims.vocab_size, max_new_tokens, temperature, top_k)
        # Already-placed parameters stay put; host arrays (e.g. a restored checkpoint) are placed.
        params = jax.device_put(params, self.param_shardings)
        window, length = self._initial_window(prompt_ids)
        settings = self._put(
            (jax.random.key(seed), np.float32(temperature), np.int32(top_k or dims.vocab_size))
        )
        pieces = []
        with jax.set_mesh(self.mesh), axis_rules(self._rules):
            for start in range(0, max_new_tokens, self.chunk):
                steps = min(self.chunk, max_new_tokens - start)
                window, length, tokens = self._decode(
                    params, window, length, *settings, *self._put((np.int32(start), np.int32(steps)))
                )
                pieces.append((tokens, steps))
        new = [int(t) for tokens, steps in pieces for t in np.asarray(jax.device_get(tokens))[:steps]]
        return SampleResult(tuple(prompt_ids), tuple(new))

    def _initial_window(self, prompt_ids: list[int]) -> tuple[jax.Array, jax.Array]:
        """The context buffer holding the prompt's last ``seq_len`` tokens, zeros after them."""
        seq_len = self.model_def.dims.seq_len
        kept = prompt_ids[-seq_len:]
        window = np.zeros(seq_len, np.int32)
        window[: len(kept)] = kept
        return self._put((window, np.int32(len(kept))))

    def _put(self, values: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        return tuple(jax.device_put(v, self._replicated) for v in values)

    def _decode_chunk(
        self,
        params: Params,
        window: jax.Array,
        length: jax.Array,
        key: jax.Array,
        temperature: jax.Array,
        top_k: jax.Array,
        start: jax.Array,
        steps: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``steps`` (<= chunk) decoding steps; returns the new window, its fill and the chunk's tokens."""
        model = self.model_def.bind(params)
        vocab_size = self.model_def.dims.vocab_size

        def step(i, carry):
            window, length, out = carry
            logits = model(window[None])[0]  # [seq_len, vocab_padded]
            last = jax.lax.dynamic_index_in_dim(logits, length - 1, axis=0, keepdims=False)
            token = choose_token(last, jax.random.fold_in(key, start + i), temperature, top_k, vocab_size)
            window, length = append_token(window, length, token)
            return window, length, out.at[i].set(token)

        out = jnp.zeros(self.chunk, jnp.int32)
        return jax.lax.fori_loop(0, steps, step, (window, length, out))


def sample(
    model_def: ModelDef,
    params: Params,
    mesh: Mesh,
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> SampleResult:
    """Continue ``prompt`` with ``max_new_tokens`` tokens from the model ``params`` on ``mesh``.

    ``params`` is the canonical parameter tree (blocks stacked ``[layers, ...]`` in layer order,
    as :meth:`ModelDef.init` makes them and checkpoints store them), ideally laid out with
    ``model_def.shardings(mesh)``; anything else is moved there first. ``prompt`` is text (its
    UTF-8 bytes are the tokens) or a list of token ids. ``temperature`` 0 is greedy decoding;
    above 0 tokens are drawn from ``softmax(logits / temperature)``, restricted to the ``top_k``
    most likely when given. ``seed`` makes sampling reproducible.

    Builds and compiles a :class:`Sampler`; to sample repeatedly from one model, keep a
    ``Sampler`` instead.
    """
    return Sampler(model_def, mesh).sample(
        params, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
    )
