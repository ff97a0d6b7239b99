"""The forward pass of a trained model on its mesh: logits and per-token losses of a batch of token ids.

What :meth:`meshtron.pretrained.Pretrained.logits` and :meth:`~meshtron.pretrained.Pretrained.loss`
run. The computation is the training loss's own (:func:`meshtron.models.contract.logits_of` and
:func:`~meshtron.models.contract.token_losses`: the model's ``loss`` when it has one), traced in
the model's scope (its rules, attention implementation and LoRA adapters), under plain ``jax.jit``
on the parameters' own layout: the compiler handles tensor-sharded weights and, on a mesh with
``pipe > 1``, the ``layers`` axis split over ``pipe`` (it inserts the communication the layer scan
needs: correct, though not a pipeline schedule).

* **Batch.** Rows are split over the mesh axes the ``batch`` rule names (``data``). A batch that
  axis does not divide is padded with rows of token 0 and the padding is cut off the result: rows
  never see each other (except through a mixture of experts with a capacity, whose drops depend on
  the tokens routed together, as in training).
* **Length.** Any length up to the model's positions runs as it is: attention is causal, so no
  position needs padding (under sequence parallelism the compiler pads a split the tensor ranks do
  not divide).
* **Compilation.** One program per (kind, padded batch, length), compiled ahead of time on the first
  call of that shape and kept: later calls of the same shape neither trace nor compile.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.models.contract import logits_of, token_losses
from meshtron.sharding import axis_names, logical_to_spec
from meshtron.train.state import ModelDef, Params


def checked_tokens(tokens: Any, vocab_size: int, longest: int | None, *, shortest: int = 1) -> np.ndarray:
    """``tokens`` as an int32 ``[batch, seq]`` host array, or one line naming what is wrong and the fix."""
    ids = np.asarray(tokens)
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"tokens: dtype {ids.dtype} is not an integer type; pass token ids as ints "
                         "(e.g. np.int32)")
    if ids.ndim != 2:
        hint = " (one sequence: tokens[None])" if ids.ndim == 1 else ""
        raise ValueError(f"tokens: shape {ids.shape} is not [batch, seq]; pass a 2-D array of ids{hint}")
    if ids.shape[0] == 0 or ids.shape[1] < shortest:
        raise ValueError(f"tokens: shape {ids.shape} needs at least one row of at least {shortest} token"
                         f"{'s' if shortest > 1 else ''}")
    if longest is not None and ids.shape[1] > longest:
        raise ValueError(f"tokens: {ids.shape[1]} tokens per row exceed the model's limit of {longest}; "
                         f"pass at most {longest} (or split the rows)")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"tokens: id {bad} is outside the vocabulary [0, {vocab_size}); use ids below {vocab_size}")
    return ids.astype(np.int32)


def checked_mask(loss_mask: Any, shape: tuple[int, int]) -> np.ndarray:
    """``loss_mask`` as a bool host array of the targets' ``shape`` (all True for None), or one line."""
    if loss_mask is None:
        return np.ones(shape, np.bool_)
    mask = np.asarray(loss_mask)
    if mask.shape != shape:
        raise ValueError(f"loss_mask: shape {mask.shape} is not the targets' {shape} ([batch, seq - 1]: "
                         "one entry per loss; a mask over the tokens is mask[:, 1:])")
    if mask.dtype != np.bool_ and (not np.issubdtype(mask.dtype, np.number) or not np.isin(mask, (0, 1)).all()):
        raise ValueError("loss_mask: holds values other than 0 and 1; pass booleans (True: the loss counts)")
    return mask.astype(np.bool_)


class Forward:
    """The compiled forward pass of one model on one mesh (see the module's docstring).

    ``max_positions``: the longest row :meth:`logits` takes (the model's positions; ``None``: no
    limit); :meth:`losses` takes one token more, as its last token is only a target. ``execution``: how
    the model's code runs (its attention implementation: the run's, which trained it).
    ``compiler_options``: XLA options its programs are compiled with (the run's ``gpu`` section:
    :func:`meshtron.xla_options.compiler_options`).
    """

    def __init__(self, model_def: ModelDef, mesh: Mesh, max_positions: int | None,
                 execution: Execution = DEFAULT_EXECUTION, compiler_options: Mapping[str, Any] | None = None):
        self.model_def = model_def
        self.compiler_options = dict(compiler_options or {})
        self.execution = execution
        self.mesh = mesh
        self.max_positions = max_positions
        self.param_shardings = model_def.shardings(mesh)
        batch_axes = logical_to_spec(("batch",), model_def.rules)[0]
        self._rows = NamedSharding(mesh, PartitionSpec(batch_axes))  # [batch, ...] split like the batch
        self._row_split = math.prod(mesh.shape[a] for a in axis_names(batch_axes or ()))
        self._programs: dict[tuple[str, int, int], jax.stages.Compiled] = {}
        self.traces = 0  # how many programs were traced (tests: one per shape)

    def logits(self, params: Params, tokens: Any) -> jax.Array:
        """Float32 logits ``[batch, seq, vocab_size]`` (the real vocabulary) of ``tokens`` [batch, seq]."""
        ids = checked_tokens(tokens, self.model_def.vocab_size, self.max_positions)
        return self._run("logits", params, ids)

    def losses(self, params: Params, tokens: Any, loss_mask: Any = None) -> jax.Array:
        """Float32 next-token losses ``[batch, seq - 1]``: entry ``t`` is the loss of ``tokens[:, t + 1]``
        predicted from ``tokens[:, :t + 1]``; zero where ``loss_mask`` (``[batch, seq - 1]``) is False."""
        longest = None if self.max_positions is None else self.max_positions + 1
        ids = checked_tokens(tokens, self.model_def.vocab_size, longest, shortest=2)
        mask = checked_mask(loss_mask, (ids.shape[0], ids.shape[1] - 1))
        return self._run("losses", params, ids, mask)

    def scores(self, params: Params, tokens: Any) -> tuple[jax.Array, jax.Array]:
        """Per target of ``tokens`` [batch, seq] (entry ``t``: ``tokens[:, t + 1]`` after ``tokens[:, :t + 1]``):
        its float32 log-probability under a softmax over the real vocabulary, and whether it is the
        argmax there (greedy decoding would pick it), both ``[batch, seq - 1]`` -- what an evaluation
        harness scores continuations with, without bringing the logits to the host."""
        longest = None if self.max_positions is None else self.max_positions + 1
        ids = checked_tokens(tokens, self.model_def.vocab_size, longest, shortest=2)
        return self._run("scores", params, ids)

    def _run(self, kind: str, params: Params, *rows: np.ndarray) -> jax.Array:
        """The ``kind`` program on ``rows`` (host arrays ``[batch, ...]``), padded to the row split and cut back."""
        batch = rows[0].shape[0]
        padded = -batch % self._row_split
        placed = [jax.device_put(np.pad(r, [(0, padded)] + [(0, 0)] * (r.ndim - 1)), self._rows) for r in rows]
        # Already-placed parameters stay put; host arrays (or another layout) are placed as compiled.
        params = jax.device_put(params, self.param_shardings)
        out = self._program(kind, params, placed)(params, *placed)
        return jax.tree.map(lambda o: o[:batch], out) if padded else out

    def _program(self, kind: str, params: Params, rows: list[jax.Array]) -> jax.stages.Compiled:
        key = (kind, *rows[0].shape[:2])
        if key not in self._programs:
            fn = {"logits": self._logits, "losses": self._losses, "scores": self._scores}[kind]
            program = jax.jit(self.model_def.traced(fn, self.execution), in_shardings=(self.param_shardings, *[self._rows] * len(rows)),
                              out_shardings=self._rows, compiler_options=self.compiler_options or None)
            with jax.set_mesh(self.mesh):
                self._programs[key] = program.lower(params, *rows).compile()
        return self._programs[key]

    def _logits(self, params: Params, tokens: jax.Array) -> jax.Array:
        self.traces += 1
        logits = self._model_logits(params, tokens)[0]
        return logits[..., : self.model_def.vocab_size].astype(jnp.float32)

    def _losses(self, params: Params, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        self.traces += 1
        logits, model = self._model_logits(params, tokens[:, :-1])
        losses = token_losses(model, logits, tokens[:, 1:]).astype(jnp.float32)
        return jnp.where(mask, losses, 0.0)

    def _scores(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        self.traces += 1
        logits = self._model_logits(params, tokens[:, :-1])[0][..., : self.model_def.vocab_size]
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        targets = tokens[:, 1:]
        chosen = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
        return chosen, jnp.argmax(logits, axis=-1) == targets

    def _model_logits(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, Any]:
        """Logits over the padded vocabulary, and the bound model (its ``loss``, if any)."""
        model = self.model_def.bind(params)
        return logits_of(model, tokens), model
