"""A trained model from a checkpoint directory, on any mesh: what ``meshtron generate`` samples from,
and what :meth:`Pretrained.logits` and :meth:`Pretrained.loss` run a forward pass of.

Only the parameters are read (orbax partial restore: the optimizer state stays on disk), straight
onto the shardings of the mesh asked for; the model's shape comes from the config the checkpoint
recorded, so nothing but the directory is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from meshtron.checkpoint import CheckpointError, CheckpointStore
from meshtron.checkpoint_dirs import checkpoint_location
from meshtron.config import Config, MeshConfig, config_from_dict
from meshtron.data.tokenizers import ByteTokenizer, Tokenizer, checkpoint_tokenizer
from meshtron.errors import ConfigError
from meshtron.execution import Execution
from meshtron.forward import Forward
from meshtron.mesh import build_mesh, resolve_sizes, simulate_devices_for
from meshtron.models.contract import ModelFactory
from meshtron.models.lora import lora_spec
from meshtron.run import check_tensor_split, stacked_layers
from meshtron.train.frozen_base import read_params
from meshtron.train.state import ModelDef, Params, model_def_from_config
from meshtron.xla_options import run_options


@dataclass
class Pretrained:
    """Canonical parameters (layers in model order) laid out on ``mesh``, and where they came from:
    ``meshtron.sample(pretrained, prompt, ...)`` decodes with its tokenizer and its window (its
    :attr:`execution`)."""

    model_def: ModelDef
    params: Params
    mesh: Mesh
    step: int
    config: Config
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)  # the one the checkpoint carries (bytes: none)
    _forward: Forward | None = field(default=None, init=False, repr=False, compare=False)  # compiled, per shape

    def logits(self, tokens: Any) -> jax.Array:
        """Float32 logits ``[batch, seq, vocab]`` of ``tokens``, an integer array ``[batch, seq]``
        (one sequence: ``tokens[None]``), over the real vocabulary (``model_def.vocab_size``).

        Any batch size and any length up to the model's positions (:attr:`max_positions`); each
        shape compiles once and is kept. A ValueError names what is wrong otherwise."""
        return self._forward_pass().logits(self.params, tokens)

    def loss(self, tokens: Any, loss_mask: Any = None) -> jax.Array:
        """Float32 next-token losses ``[batch, seq - 1]`` of ``tokens`` ``[batch, seq]``: entry ``t`` is
        the loss of ``tokens[:, t + 1]`` predicted from ``tokens[:, :t + 1]`` -- the model's own
        ``loss`` if it has one, else cross-entropy over the real vocabulary, as in training.

        ``loss_mask``: booleans (or 0/1) shaped like the result, False where a loss does not count
        (it is then 0); a mask over the tokens, as meshtron's fine-tuning masks are, is
        ``mask[:, 1:]``. Rows hold up to :attr:`max_positions` + 1 tokens (the last is only a
        target)."""
        return self._forward_pass().losses(self.params, tokens, loss_mask)

    def scores(self, tokens: Any) -> tuple[jax.Array, jax.Array]:
        """Float32 log-probabilities ``[batch, seq - 1]`` of each next token of ``tokens`` under a softmax
        over the real vocabulary, and whether each is the argmax (greedy) choice; rows as :meth:`loss`."""
        return self._forward_pass().scores(self.params, tokens)

    @property
    def execution(self) -> Execution:
        """How the run that trained it executed the model (its attention implementation, its window:
        generation's default context), as its recorded config says."""
        return Execution.of_model_config(self.config.model)

    @property
    def max_positions(self) -> int:
        """The longest sequence the model runs over: its own ``max_len`` (a GPT's position table), else
        the config's ``model.max_position_embeddings``, else its training window ``model.seq_len``."""
        return self.model_def.max_len or self.config.model.max_position_embeddings or self.config.model.seq_len

    def _forward_pass(self) -> Forward:
        """The compiled forward pass for this model and mesh (rebuilt if either was replaced)."""
        held = self._forward
        execution = self.execution
        if held is None or held.model_def is not self.model_def or held.mesh is not self.mesh \
                or held.execution != execution:
            self._forward = Forward(self.model_def, self.mesh, self.max_positions, execution,
                                    run_options(self.config.gpu.overlap, self.config.gpu.xla_flags))
        return self._forward


def saved_config(directory: str | Path, *, argument: str = "directory") -> tuple[CheckpointStore, Config]:
    """The run config recorded by the newest readable checkpoint in ``directory`` (errors name it as
    ``argument``: the caller's parameter or flag)."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{argument} {directory}: no such directory; give a run's checkpoint.dir or an import")
    parent, step = checkpoint_location(path)
    if step is not None:
        raise CheckpointError(f"{argument} {directory}: is step {step} of the checkpoint directory {parent}; pass "
                              f"{parent} (its newest intact step is used)")
    store = CheckpointStore(path, read_only=True)
    for step in reversed(store.steps()):
        try:
            return store, config_from_dict(store.read_meta(step)["config"], f"checkpoint {path}/{step}")
        except (ValueError, KeyError, OSError):  # damaged: restore_newest says so, and falls back
            continue
    store.close()
    raise CheckpointError(f"{argument} {directory}: holds no readable meshtron checkpoint; give a run's "
                          "checkpoint.dir or an import")


def load_pretrained(directory: str | Path, mesh: MeshConfig | None = None, devices=None, *,
                    model: ModelFactory | None = None, rules: dict[str, str | None] | None = None,
                    argument: str = "directory") -> Pretrained:
    """The newest intact checkpoint's parameters on ``mesh`` (default: the mesh that trained them).

    ``model`` and ``rules``: the factory and rules a run of your own model was trained with
    (``Trainer.from_config(..., model=, rules=)``); the config's family or factory otherwise.

    Any mesh whose tensor size splits the model's heads and MLP works; the vocabulary padding is
    adjusted to the tensor size (padded rows are never sampled). ``argument``: how errors name
    ``directory`` (the CLI passes its flag).
    """
    store, cfg = saved_config(directory, argument=argument)
    try:
        mesh_cfg = mesh or cfg.mesh
        if mesh is None:  # decoding does not split sequences: the training mesh without its context axis
            mesh_cfg = replace(mesh_cfg, context=1)
        elif mesh_cfg.context != 1:
            raise ConfigError(f"parallel.context: generation does not split sequences over context ranks (got "
                              f"{mesh_cfg.context}); use parallel.context=1")
        if devices is None:  # on a CPU, as many simulated devices as the mesh needs (if JAX has not started)
            simulate_devices_for(mesh_cfg)
        devices = list(jax.devices() if devices is None else devices)
        mesh_cfg = resolve_sizes(mesh_cfg, len(devices))
        pipe, tensor = mesh_cfg.pipe, mesh_cfg.tensor
        if cfg.model.sequence_parallel and tensor == 1:  # nothing to split the sequence over: the same model
            cfg = replace(cfg, model=replace(cfg.model, sequence_parallel=False))
        if model is None:  # a model passed in is checked parameter by parameter (check_mesh below)
            check_tensor_split(cfg.model, mesh_cfg)
        if stacked_layers(cfg.model) % pipe:
            raise ConfigError(f"parallel.pipe: {pipe} does not divide the model's {stacked_layers(cfg.model)} stacked "
                              "layers; use a pipe size that does (or 1)")
        device_mesh = build_mesh(mesh_cfg, devices)
        # a LoRA run's checkpoint holds its adapters: the model carries them and merges them as it runs
        model_def = model_def_from_config(cfg.model, tensor, rules=rules, factory=model, adaptation=lora_spec(cfg.train.lora))
        model_def.check_mesh(device_mesh)
        # (an adapter-only LoRA checkpoint gets its frozen base back from where it points)
        params, meta = read_params(store, model_def, device_mesh, model_def.shardings(device_mesh), step=None,
                                   source=argument, seed=cfg.train.seed)
    finally:
        store.close()
    return Pretrained(model_def, params, device_mesh, meta["step"], replace(cfg, mesh=mesh_cfg),
                      checkpoint_tokenizer(directory))
