"""Typed run configuration: dataclass sections, YAML files and dotted ``key=value`` overrides.

The schema lives here as plain dataclasses; OmegaConf does the merging of defaults, YAML files
and command-line overrides and the type checking. Every failure is re-raised as one
:class:`ConfigError` that names the dotted field and says how to fix it, so users never see an
OmegaConf or JAX traceback for a typo.

The parallel layout is one section, ``parallel`` (:class:`ParallelConfig`: the mesh's sizes, the
pipeline schedule, microbatches, ZeRO, sequence and context parallelism), as torchtitan's
``ParallelismConfig`` has it. Its fields used to live in ``mesh``, ``pipeline``, ``model`` and
``train``; those keys are still read as aliases of the new ones (:data:`ALIASES`): a file or
command line that uses one gets one ``meshtron: ... is deprecated`` line on stderr per run, and one
that sets an old key and its new key to different values is refused. The invariant:
``parallel`` is what users write and what ``--print-config`` (and every config meshtron saves,
:func:`to_dict`) shows; the old sections' copies are what code reads (``cfg.mesh.data``,
``cfg.train.zero``, ...). A :class:`Config` holds both, always equal: :func:`load_config` and
:func:`config_from_dict` copy the resolved ``parallel`` into the old fields, and a Config made or
changed in Python (``Config(mesh=...)``, ``dataclasses.replace(cfg, mesh=...)``) derives
``parallel`` from the old fields (``Config.__post_init__``; ``parallel`` is not an argument).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.util
import math
import os
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from meshtron.bundled_configs import resolve
from meshtron.checkpoint_dirs import imported_step
from meshtron.errors import ConfigError
from meshtron.execution import EXCHANGES, FP8_RECIPES, REMAT_MODES
from meshtron.families import FAMILIES
from meshtron.xla_options import compiler_options

DTYPES = ("float32", "bfloat16", "float16")
CONTEXT_EXCHANGES = EXCHANGES  # (the names live with the run's other switches: meshtron.execution)


@dataclass
class MeshConfig:
    """Degrees of data, pipeline, tensor and context parallelism; at most one may be -1 ("the rest").
    Users write them as ``parallel.data`` ... ``parallel.context`` (:class:`ParallelConfig`); this is
    the copy code reads.

    ``context`` splits every sequence over its ranks (context parallelism: each rank holds
    ``seq_len / context`` tokens, and attention exchanges keys and values over the axis as
    ``parallel.context_attention`` says); gradients are then reduced over data x context."""

    data: int = -1
    pipe: int = 1
    tensor: int = 1
    context: int = 1


@dataclass
class MoEConfig:
    """Mixture of experts in place of every block's MLP (``llama``; :mod:`meshtron.models.moe`).

    ``experts`` 0 is a dense model. Each token goes to ``top_k`` experts of ``mlp_dim`` (null: the
    model's ``mlp_dim``); ``capacity_factor`` 0 is dropless, > 0 caps each expert at
    ``ceil(capacity_factor · tokens · top_k / experts)`` assignments and drops the rest.
    ``shared_experts`` always-on experts of the same width run on every token.

    ``router``: ``softmax`` (Mixtral) or ``sigmoid`` (DeepSeek-V3) scores; ``routed_scaling_factor``
    multiplies the combine weights. ``n_group``/``topk_group``: the experts split into ``n_group``
    groups of which each token may use the ``topk_group`` best (null: all). ``bias_update_rate`` > 0:
    aux-loss-free balancing, a per-expert bias on the scores for selection that each step moves by this
    rate towards the mean load; ``selection_bias`` keeps that bias with a rate of 0, fixed (an imported
    DeepSeek-V3's ``e_score_correction_bias``). ``sequence_aux_loss_weight``: DeepSeek-V3's per-sequence balance loss.
    ``dispatch``: how expert parallelism moves rows to the experts: ``padded`` (an all-to-all of each
    destination's worst case) or ``ragged`` (``ragged_all_to_all`` of the routed rows; dropless only;
    without expert parallelism there is no exchange and it changes nothing).
    """

    experts: int = 0
    top_k: int = 2
    mlp_dim: int | None = None
    capacity_factor: float = 0.0
    aux_loss_weight: float = 0.01  # the load-balancing loss's weight, per layer (Megatron's moe_aux_loss_coeff)
    z_loss_weight: float = 0.0  # the router z-loss's weight, per layer (ST-MoE: 1e-3)
    shared_experts: int = 0
    normalize_top_k: bool = True  # renormalise the chosen experts' probabilities to sum to 1 (Mixtral)
    router: str = "softmax"  # the scores of the router's logits: softmax (Mixtral) or sigmoid (DeepSeek-V3)
    routed_scaling_factor: float = 1.0  # multiplies the combine weights (after any renormalisation)
    n_group: int = 1  # expert groups for group-limited routing (1: no limit)
    topk_group: int | None = None  # groups each token may use (null: all n_group)
    bias_update_rate: float = 0.0  # aux-loss-free balancing's per-step bias update (0: off; DeepSeek-V3: 1e-3)
    # A selection bias even with bias_update_rate 0, where it stays as it is: an imported DeepSeek-V3's
    # e_score_correction_bias, which chooses its experts (bias_update_rate > 0 always has one).
    selection_bias: bool = False
    sequence_aux_loss_weight: float = 0.0  # DeepSeek-V3's sequence-wise balance loss, per layer
    dispatch: str = "padded"  # expert parallelism's exchange: padded (worst-case all-to-all) or ragged (routed rows)


@dataclass
class MlaConfig:
    """Multi-head latent attention (``deepseek``; :mod:`meshtron.models.deepseek`), with Hugging Face's
    DeepSeek-V2/V3 field names.

    Queries go through a ``q_lora_rank``-wide latent (null: one projection, DeepSeek-V2-Lite's);
    keys and values through a shared ``kv_lora_rank``-wide latent, which is all a decoding cache
    holds per token besides the ``qk_rope_head_dim``-wide rotary key shared by every head. Each head
    has ``qk_nope_head_dim + qk_rope_head_dim`` query/key features and ``v_head_dim`` value features.
    ``rope_interleave``: the rotary features are rotated in adjacent pairs (DeepSeek's checkpoints;
    Hugging Face's default), else in halves (Llama's).
    """

    q_lora_rank: int | None = None
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rope_interleave: bool = True


@dataclass
class MtpConfig:
    """DeepSeek-V3's multi-token prediction (``deepseek``; :mod:`meshtron.models.mtp`): ``layers``
    sequential modules after the last block, module ``k`` predicting the token ``k + 1`` places past
    the next one from the previous depth's hidden state and the embedding of token ``i + k``, through
    the model's shared embedding and output head. Their mean cross-entropy times ``loss_weight`` joins
    the objective (reported apart as ``mtp/loss``). 0 layers: none. ``loss_weight`` 0.3 is the
    paper's for its first 10T tokens (then 0.1)."""

    layers: int = 0
    loss_weight: float = 0.3


@dataclass
class ModelConfig:
    """The model: a built-in ``family`` (gpt, llama, deepseek) or a user's ``factory`` (``package.module:function``
    called as ``function(model_config, rngs)``), its sizes, dtypes and activation recomputation.

    ``kv_heads`` (llama): key/value heads for grouped-query attention, null = ``heads``. ``rules``:
    additions to or overrides of the logical -> mesh axis table, e.g. ``{ffn: tensor}`` for a model's
    own axis name, ``{kv_heads: null}`` to replicate one. ``sequence_parallel``, ``context_attention``,
    ``ulysses_degree`` and ``collective_matmul`` are the copies code reads of their ``parallel.*`` fields, which users
    write (:class:`ParallelConfig`).
    """

    family: str = "gpt"
    factory: str | None = None
    vocab_size: int = 256
    hidden: int = 128
    heads: int = 4
    layers: int = 4
    mlp_dim: int = 512
    seq_len: int = 128
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"  # none | full (keep block inputs only) | selective (recompute the attention core) | offload (full, block inputs in host memory)
    sequence_parallel: bool = False  # split norm/residual activations over the sequence on the tensor ranks
    collective_matmul: bool = False  # sequence parallelism's gathers and reduce-scatters as rings overlapped with the GEMMs
    gradient_accumulation_fusion: bool = False  # weight gradients leave their GEMMs in float32 (models/master_weight_gemm.py)
    cast_once: bool = False  # a pipeline stage's weights cast to dtype once per step (models/cast_weights.py)
    kv_heads: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5  # epsilon of every LayerNorm (gpt) / RMSNorm (llama)
    # The longest sequence the model is made for (Hugging Face's and Megatron's max_position_embeddings):
    # a GPT's position table, a Llama's advertised context; null = seq_len. seq_len is the training window.
    max_position_embeddings: int | None = None
    attention: str = "xla"  # jax.nn.dot_product_attention's implementation: xla, or cudnn (flash attention, GPUs)
    # off | current | delayed: the blocks' projections as FP8 GEMMs, scaled per tensor by its own amax (current)
    # or by the largest amax of the last fp8_amax_history steps (delayed; models/fp8.py, models/fp8_scaling.py)
    fp8: str = "off"
    fp8_amax_history: int = 16
    # Attention over a sequence split on parallel.context: gathered (keys and values all-gathered), ring
    # (blocks passed around, two resident at a time), ulysses (all-to-alls swap the sequence split for a head
    # split: each rank attends over the whole sequence for heads/context heads) or hybrid (ulysses over
    # ulysses_degree consecutive ranks, a ring across the groups). Ignored with parallel.context=1.
    context_attention: str = "gathered"
    ulysses_degree: int = 1  # hybrid: the context ranks each all-to-all joins (1 < it < parallel.context, dividing it)
    rules: dict[str, str | None] = field(default_factory=dict)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MlaConfig = field(default_factory=MlaConfig)
    # Rotary scaling as Hugging Face's config writes it (deepseek: YaRN, {type: yarn, factor,
    # original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}); null: none.
    rope_scaling: dict[str, Any] | None = None
    first_k_dense_replace: int = 0  # deepseek with model.moe.experts: the first k blocks keep a dense MLP
    mtp: MtpConfig = field(default_factory=MtpConfig)


@dataclass
class LoraConfig:
    """Low-rank adapters (``rank`` > 0 turns them on): the model's block matrices are frozen and each
    chosen one trains ``W + (alpha / rank) · A B`` instead (:mod:`meshtron.models.lora`). ``targets``:
    dotted path patterns (``"*attn*"``) or ``"axis:NAME"`` (matrices with that logical axis); ``["*"]``
    is every projection into or out of the residual stream. ``dropout``: of the adapters' inputs in
    training (on matrices the model applies through ``nnx.Linear`` / ``nnx.Einsum``). Checkpoints hold the
    adapters and point to the frozen base (``train.init_from``'s checkpoint, or the seed);
    ``save_base`` writes the base into each of them too (:mod:`meshtron.train.frozen_base`)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["*"])
    save_base: bool = False


# The experiment trackers a run can write to (``train.trackers``) -> the extra that installs each one's
# library (``pip install 'meshtron[wandb]'``); the library's module has the same name.
TRACKERS = ("wandb", "mlflow")


@dataclass
class WandbConfig:
    """Weights & Biases (``train.trackers: [wandb]``). Null fields are W&B's own: its environment
    (``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_NAME``, ``WANDB_MODE=offline``, ``WANDB_DIR``) or its
    defaults; meshtron passes only what is set here."""

    project: str | None = None
    entity: str | None = None
    name: str | None = None  # the run's display name
    tags: list[str] = field(default_factory=list)


@dataclass
class MlflowConfig:
    """MLflow (``train.trackers: [mlflow]``). ``experiment`` null: ``MLFLOW_EXPERIMENT_NAME``, else
    MLflow's ``Default``; ``tracking_uri`` null: ``MLFLOW_TRACKING_URI``, else MLflow's default (a SQLite
    file ``mlflow.db`` in the working directory); ``run_name`` null: one MLflow makes up."""

    experiment: str | None = None
    run_name: str | None = None
    tracking_uri: str | None = None


@dataclass
class DpoConfig:
    """Direct preference optimisation (``train.objective: dpo``, :mod:`meshtron.models.preference`):
    ``beta`` scales the log-probability ratios (TRL's default 0.1); ``label_smoothing``: the share of
    pairs assumed mislabelled (conservative DPO, in [0, 0.5)); ``loss``: ``sigmoid`` (DPO's logistic
    loss) or ``ipo`` (IPO's squared one). The reference model is the frozen base with LoRA, else
    ``train.init_from``'s weights, whose log-probabilities ``precompute_reference`` computes in one pass
    over the data before training instead of keeping a second copy of the model."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss: str = "sigmoid"
    precompute_reference: bool = False


OBJECTIVES = ("lm", "dpo")
DPO_LOSSES = ("sigmoid", "ipo")


@dataclass
class TrainConfig:
    """The optimisation: global batch (sequences), microbatches, optimizer and schedule.

    ``init_from``: a checkpoint directory (a run's ``checkpoint.dir``, an import) or one of its step
    directories that a *new* run starts from -- its parameters, at step 0, with a fresh optimizer
    state, saving to its own ``checkpoint.dir`` (Megatron's ``--load`` + ``--finetune``, MaxText's
    ``load_parameters_path``). Used only when ``checkpoint.dir`` holds no checkpoint yet: a run
    that has saved resumes from its own. ``init_optimizer: true`` takes that run's optimizer state
    too, and with it its position (step, updates, data): the new run continues that run under a
    new directory (Megatron's ``--load A --save B``), because moments, step counts and the
    learning-rate schedule only make sense together.

    ``microbatches``, ``zero`` and ``gather_once`` are the copies code reads of ``parallel.*``,
    which users write (:class:`ParallelConfig`).
    """

    steps: int = 300
    batch_size: int = 32
    microbatches: int = 1
    optimizer: str = "adamw"
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float | None = None  # null: 1.0 for adamw/lamb, off for onebit_lamb (optim.grad_clip_norm)
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    on_nonfinite: str = "stop"  # a NaN/Inf loss or update: "stop" the run, or "skip" that step's update
    max_skipped_steps: int = 10  # with "skip": stop after this many non-finite steps in a row
    max_minutes: float | None = None  # wall-clock budget of a run: stop (with a checkpoint) at the step that passes it
    tensorboard: str | None = None  # a directory for TensorBoard event files (the CLI's --tensorboard)
    trackers: list[str] = field(default_factory=list)  # experiment trackers fed the same records: wandb, mlflow
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    profile_steps: str | None = None  # "a:b": a jax.profiler trace of steps a..b into profile_dir
    profile_dir: str = "profile"
    peak_flops: float | None = None  # one device's peak FLOP/s (e.g. 989e12, H100 bf16 dense): logs utilisation
    init_from: str | None = None  # a checkpoint directory (or step directory) a new run starts from
    init_optimizer: bool = False  # with init_from: also its optimizer state and position (continue that run)
    zero: int = 0  # split over data: 0 nothing, 1 optimizer state (distributed optimizer), 3 also parameters (FSDP)
    offload_optimizer: bool = False  # optimizer state in pinned host memory between steps, moved in for the update
    gather_once: bool = False  # zero=3: gather parameters once per step, not each layer's before each use
    gather_dtype: str | None = None  # zero=3: the dtype parameters are gathered in (null: model.dtype)
    reduce_dtype: str | None = None  # zero=3: the dtype their gradients are reduced in (null: model.param_dtype)
    lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters on a frozen model (rank 0: off)
    objective: str = "lm"  # lm: next-token loss; dpo: preference pairs (data from meshtron preprocess --preference)
    dpo: DpoConfig = field(default_factory=DpoConfig)  # with objective=dpo


OPTIMIZERS = ("adamw", "lamb", "onebit_lamb")


@dataclass
class OptimConfig:
    """Optimizer hyperparameters beyond ``train.lr``/``weight_decay``/``grad_clip``.

    ``b1``, ``b2``, ``eps``: null = the optimizer's own default (AdamW 0.9/0.95/1e-8, LAMB
    0.9/0.999/1e-6, 1-bit LAMB 0.9/0.999/1e-8). The rest are 1-bit LAMB's (DeepSpeed's defaults);
    ``freeze_step`` null = 16% of ``train.steps`` (the warmup that gives ~4.6x less traffic).
    """

    b1: float | None = None
    b2: float | None = None
    eps: float | None = None
    freeze_step: int | None = None
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1


@dataclass
class DataConfig:
    """Where the tokens come from.

    ``path``: a UTF-8 text file, or the prefix of a Megatron-LM indexed token dataset (``PREFIX.bin`` +
    ``PREFIX.idx``, written by ``meshtron preprocess`` or Megatron's tools); null: the built-in corpus
    (CPython 3.11.7's pydoc topics, shipped). ``blend``: ``[w1, prefix1, w2, prefix2, ...]``, indexed
    datasets mixed by weight (Megatron's rule), instead of ``path``. ``tokenizer``: how a text file is
    tokenized: ``bytes``, a Hugging Face ``tokenizer.json`` or a SentencePiece ``.model`` (an indexed
    dataset is already tokens; its tokenizer is what ``generate`` decodes with). ``holdout_fraction``:
    the held-out tail (of the text, or of the documents of each indexed dataset).

    ``reset_per_document``: every document of a window attends, is positioned and predicts on its own
    (Megatron-LM's ``--reset-attention-mask --reset-position-ids --eod-mask-loss``, from the indexed
    dataset's document boundaries); off by default (documents run into each other). Supervised
    fine-tuning data (``meshtron preprocess --sft``) is always packed that way, its loss on the answers.

    ``source``: ``indexed`` (the above: a text file or indexed datasets), ``hf`` (``path`` is a local
    Hugging Face dataset -- a Parquet or JSON-lines file or folder, or a ``save_to_disk`` folder -- read
    as a stream) or ``grain`` (``path`` is Parquet or ArrayRecord files, read through a Grain data
    source): the examples' ``text_field`` is tokenized with ``tokenizer`` while the run trains and
    packed into windows; ``blend`` then mixes such paths by weight (:mod:`meshtron.data.streaming`).

    ``pairs_per_window``: preference pairs (``train.objective: dpo``) packed into one chosen window and
    its rejected window, at most this many, each conversation a document of its own (TRL's
    ``padding_free``); 1: one pair a window pair, padded to ``model.seq_len``. When above 1,
    ``train.batch_size`` counts window pairs, not pairs (:mod:`meshtron.data.preference`).
    """

    path: str | None = None
    holdout_fraction: float = 0.1
    tokenizer: str = "bytes"
    blend: list[Any] | None = None
    reset_per_document: bool = False
    source: str = "indexed"
    text_field: str = "text"
    pairs_per_window: int = 1


@dataclass
class PipelineConfig:
    """The pipeline schedule used when ``parallel.pipe > 1`` (``chunks`` = v for interleaved). Users
    write these as ``parallel.schedule``, ``parallel.chunks``, ``parallel.recompute`` and
    ``parallel.layout`` (:class:`ParallelConfig`); this is the copy code reads.

    ``recompute``: true (default) keeps only each in-flight microbatch's stage input and reruns the
    stage's forward inside its backward (least memory, a third more compute; under
    ``model.remat=full`` each layer is then recomputed once more in its own backward, three forwards
    in all). false keeps, per in-flight microbatch, what each layer keeps by ``model.remat``: its
    matmul outputs with ``none`` or ``selective`` (Megatron's default without
    ``--recompute-granularity``: no recomputed forward, most activation memory), its input alone
    with ``full`` (Megatron's ``--recompute-granularity full``: each layer recomputed once, two
    forwards).

    ``layout``: how many layers each virtual stage runs when they do not split evenly (or should not:
    the first stage also embeds, the last also computes the loss), as ``p·v`` counts (``[3, 5]``) or
    a Megatron-style string (``"Et*3|t*5L"``); see :mod:`meshtron.pipeline.layout`.
    """

    schedule: str = "1f1b"
    chunks: int = 1
    recompute: bool = True
    layout: Any = None  # None: layers split evenly; else per-virtual-stage counts or a Megatron layout string


@dataclass
class CheckpointConfig:
    """Orbax checkpoints: ``dir`` null = none. A run whose ``dir`` holds checkpoints resumes from the
    newest complete one (``resume: false`` refuses to start there instead of overwriting).

    ``onebit_errors``: 1-bit LAMB's per-device error-feedback buffers. ``keep`` saves them and
    restores them when the checkpoint's mesh layout is the run's (exact resume); on another
    layout they are reset to zero, as DeepSpeed does. ``reset`` never saves them (they take
    data-parallel-size times the model's size on disk).
    """

    dir: str | None = None
    every: int = 100
    keep: int = 3
    async_save: bool = True
    resume: bool = True
    onebit_errors: str = "keep"


@dataclass
class DistributedConfig:
    """Multi-process start-up (``jax.distributed.initialize``). Unset fields come from the environment
    (``MESHTRON_COORDINATOR_ADDRESS``, ``MESHTRON_NUM_PROCESSES``, ``MESHTRON_PROCESS_ID``, as set by
    ``meshtron launch``) or from JAX's cluster auto-detection (SLURM, Open MPI, ...). With none of
    them the run is single-process.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_devices: int | None = None  # CPU only: simulated devices per process (default: the mesh / processes)
    initialization_timeout: int = 300  # seconds to wait for every process to join
    heartbeat_timeout: int = 30  # seconds without news from a process before the others stop


@dataclass
class GpuConfig:
    """XLA:GPU compiler options every program of the run is compiled with (:mod:`meshtron.xla_options`):
    ``overlap`` ``on`` turns on the bundle of scheduling flags measured to hide more tensor and pipe
    communication, and on GPUs the pipeline's early sends (:meth:`meshtron.run.Run.pipeline_on`); ``xla_flags`` (``XLA_FLAGS`` syntax, ``--name=value ...``) adds an expert's own,
    which win over the bundle's. XLA:CPU ignores them."""

    overlap: str = "off"
    xla_flags: str | None = None


@dataclass
class ParallelConfig:
    """The parallel layout, one section (torchtitan's ``ParallelismConfig``): the mesh's degrees of
    data, pipeline, tensor and context parallelism (at most one -1, "the rest of the devices"), the
    pipeline schedule, the microbatches, ZeRO and sequence/context parallelism.

    ``context`` splits every sequence over its ranks (each holds ``seq_len / context`` tokens, and
    attention exchanges keys and values over the axis as ``context_attention`` says); gradients are
    then reduced over data x context. ``schedule``, ``chunks`` (v for interleaved), ``recompute``
    and ``layout`` are the pipeline's when ``pipe > 1``: see :class:`PipelineConfig`.

    What users write; code reads the copies in ``mesh``, ``pipeline``, ``model`` and ``train``
    (the module's docstring)."""

    data: int = -1
    pipe: int = 1
    tensor: int = 1
    context: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    layout: Any = None  # None: layers split evenly; else per-virtual-stage counts or a Megatron layout string
    recompute: bool = True  # rerun each stage's forward in its backward (least memory): see PipelineConfig
    microbatches: int = 1  # per data shard, each step
    zero: int = 0  # split over data: 0 nothing, 1 optimizer state (distributed optimizer), 3 also parameters (FSDP)
    gather_once: bool = False  # zero=3: gather parameters once per step, not each layer's before each use
    # zero=3's mixed precision (torchtitan's FSDP MixedPrecisionPolicy): parameters are gathered in
    # gather_dtype (null: model.dtype, the compute dtype, so a bf16 model gathers half the bytes) and the
    # gradients of what was gathered are reduce-scattered in reduce_dtype (null: model.param_dtype).
    gather_dtype: str | None = None
    reduce_dtype: str | None = None
    sequence_parallel: bool = False  # split norm/residual activations over the sequence on the tensor ranks
    # With sequence_parallel: each block's all-gathers and reduce-scatters of the residual stream done by its
    # projections as rings of collective-permutes, each step's GEMM overlapping the next transfer
    # (models/collective_matmul.py).
    collective_matmul: bool = False
    # Each projection's weight gradient computed by a GEMM with a float32 result, handed to the float32
    # gradient without a round trip through the compute dtype; the accumulation over microbatches then
    # adds a GEMM's output (models/master_weight_gemm.py; Megatron's --gradient-accumulation-fusion).
    gradient_accumulation_fusion: bool = False
    # A pipeline stage's projection weights cast to model.dtype (and fused projections' kernels joined) once per
    # step, before the tick loop, instead of at every microbatch's forward, recomputation and W pass; held for
    # the step in model.dtype (models/cast_weights.py; Megatron holds the model's weights in bf16).
    cast_once: bool = False
    # Attention over a sequence split on parallel.context: gathered (keys and values all-gathered), ring
    # (blocks passed around, two resident at a time), ulysses (all-to-alls swap the sequence split for a head
    # split: each rank attends over the whole sequence for heads/context heads) or hybrid (ulysses over
    # ulysses_degree consecutive ranks, a ring across the groups). Ignored with parallel.context=1.
    context_attention: str = "gathered"
    ulysses_degree: int = 1  # hybrid: the context ranks each all-to-all joins (1 < it < parallel.context, dividing it)


# The old spelling of each parallel.* key (where code still reads it) -> the new one.
ALIASES: dict[str, str] = {
    **{f"mesh.{name}": f"parallel.{name}" for name in ("data", "pipe", "tensor", "context")},
    **{f"pipeline.{name}": f"parallel.{name}" for name in ("schedule", "chunks", "layout", "recompute")},
    **{f"train.{name}": f"parallel.{name}"
       for name in ("microbatches", "zero", "gather_once", "gather_dtype", "reduce_dtype")},
    **{f"model.{name}": f"parallel.{name}" for name in ("sequence_parallel", "context_attention", "ulysses_degree",
                                                                "collective_matmul", "gradient_accumulation_fusion",
                                                                "cast_once")},
}


@dataclass
class Config:
    # parallel is derived from the old sections here (not an argument: Config(mesh=...) and
    # dataclasses.replace(cfg, mesh=...) keep the two equal); load_config fills it from a file.
    parallel: ParallelConfig = field(default_factory=ParallelConfig, init=False)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)

    def __post_init__(self) -> None:
        self.parallel = ParallelConfig(**{new.partition(".")[2]: _get(self, old) for old, new in ALIASES.items()})


# The sections users write (mesh and pipeline are the old spellings of parallel's keys).
SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in ("mesh", "pipeline"))


def _get(cfg: Config, dotted: str) -> Any:
    section, _, name = dotted.partition(".")
    return getattr(getattr(cfg, section), name)


def _adopt_parallel(cfg: Config) -> Config:
    """``cfg`` (as OmegaConf makes it: ``parallel`` as written, the old fields at their defaults)
    with ``parallel``'s values copied into the old fields that code reads."""
    for old, new in ALIASES.items():
        section, _, name = old.partition(".")
        setattr(getattr(cfg, section), name, _get(cfg, new))
    return cfg


def upgraded(values: dict[str, Any], origin: str = "saved config") -> dict[str, Any]:
    """A config as a plain dict (a file, a checkpoint's record) with every old key moved to its
    ``parallel.*`` spelling; silent (the reader is meshtron). An old key set beside its new one to a
    different value is a :class:`ConfigError`."""
    return _upgrade(values, origin)[0]


def _upgrade(values: dict[str, Any], origin: str) -> tuple[dict[str, Any], list[str]]:
    """``upgraded(values)`` and the old keys it used, in :data:`ALIASES`' order."""
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in values.items()}
    used = []
    for old, new in ALIASES.items():
        section, _, name = old.partition(".")
        holder = out.get(section)
        if not isinstance(holder, dict) or name not in holder:
            continue
        target = out.setdefault("parallel", {})
        if target is None:
            target = out["parallel"] = {}
        if not isinstance(target, dict):
            continue  # parallel: <not a mapping>: the merge names it
        value = holder.pop(name)
        key = new.partition(".")[2]
        if key in target and target[key] != value:
            raise ConfigError(f"{old} and {new} ({origin}): both set, to {value!r} and {target[key]!r}; {old} is the "
                              f"old name of {new}: write only {new}")
        target[key] = value
        used.append(old)
    for section in {old.partition(".")[0] for old in used} & {"mesh", "pipeline"}:
        if out[section] == {}:  # all moved: as to_dict writes it
            del out[section]
    return out, used


def note_deprecated(used: list[str]) -> None:
    """One line on stderr naming the old keys a run's input used (on the first process only:
    ``MESHTRON_PROCESS_ID``, :mod:`meshtron.distributed`)."""
    if not used or os.environ.get("MESHTRON_PROCESS_ID", "0") not in ("", "0"):
        return
    old = ", ".join(used)
    new = ", ".join(ALIASES[key] for key in used)
    verb = "is" if len(used) == 1 else "are"
    print(f"meshtron: {old} {verb} deprecated; write {new}", file=sys.stderr)


# ``${config_dir:}`` in a config file is the file's own directory, so that a file kept beside the
# checkpoints it describes (an import's config.yaml) still names them when the directory is moved
# or copied: it records no absolute path to itself.
_CONFIG_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("meshtron_config_dir", default=None)


def _config_dir() -> str:
    directory = _CONFIG_DIR.get()
    if directory is None:
        raise ConfigError("${config_dir:} is the directory of the config file it is written in; use it in a "
                          "--config file, not on the command line without one")
    return str(directory)


OmegaConf.register_resolver("config_dir", _config_dir, replace=True)


@contextlib.contextmanager
def _reading_from(directory: Path | None) -> Iterator[None]:
    token = _CONFIG_DIR.set(directory)
    try:
        yield
    finally:
        _CONFIG_DIR.reset(token)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                preset: list[str] | tuple[str, ...] = (), fixed: list[str] | tuple[str, ...] = (),
                notes: bool = True) -> Config:
    """Defaults, then the YAML file (if any), then ``section.key=value`` overrides; validated.

    In the file, ``${config_dir:}`` stands for the file's own directory (absolute). Old keys
    (:data:`ALIASES`) in the file or the overrides are read as their ``parallel.*`` keys, with one
    deprecation line on stderr (``notes=False``: none, for a second reading of the same input); an
    old key and its new one set to different values in the same file, or on the same command line,
    is an error (a later layer overrides an earlier one, in either spelling). ``preset`` and
    ``fixed``: meshtron's own overrides, applied before the file and after the user's overrides."""
    merged = OmegaConf.structured(Config)
    layers: list[tuple[str, Any, bool]] = []
    directory = None
    if preset:
        layers.append(("meshtron's settings", _parse_overrides(preset), False))
    if path is not None:
        file = resolve(path)  # a file, else a bundled config's name (cpu8)
        directory = file.absolute().parent
        # An import's own config.yaml (meshtron import-hf writes it beside the imported model, in the
        # spelling of its day) is meshtron's writing: read without a note, as a checkpoint's record is.
        written = not (file.name == "config.yaml" and imported_step(directory) is not None)
        layers.append((f"config file {path}", _read_yaml(file), written))
    if overrides:
        layers.append(("command line", _parse_overrides(overrides), True))
    if fixed:
        layers.append(("meshtron's settings", _parse_overrides(fixed), False))
    used: list[str] = []
    for origin, layer, written in layers:
        layer, old_keys = _upgrade(layer, origin)
        used += [key for key in old_keys if written and key not in used]
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise _explain(err, origin) from None
    with _reading_from(directory):
        try:
            cfg = OmegaConf.to_object(merged)
        except OmegaConfBaseException as err:
            raise _explain(err, "config file" if path is None else f"config file {path}") from None
    assert isinstance(cfg, Config)
    if notes:
        note_deprecated(sorted(used, key=list(ALIASES).index))
    _adopt_parallel(cfg)
    _read_switches(cfg)
    validate(cfg)
    return cfg


# Fields whose values are words like ``off``/``on``: YAML 1.1 reads a bare off/on/no/yes as a boolean,
# which the string field then holds as "False"/"True".
SWITCH_FIELDS = ("model.fp8", "gpu.overlap")


def _read_switches(cfg: Config) -> None:
    """``off``/``on`` back in the :data:`SWITCH_FIELDS` a YAML file or an override wrote bare."""
    for dotted in SWITCH_FIELDS:
        section, _, name = dotted.partition(".")
        value = _get(cfg, dotted)
        if value in ("False", "True"):
            setattr(getattr(cfg, section), name, "off" if value == "False" else "on")


def config_from_dict(values: dict, origin: str) -> Config:
    """A :class:`Config` from a plain dict (as a checkpoint records it, in either spelling: old
    records have ``mesh``/``pipeline`` keys), type-checked, not validated against devices or files
    (a recorded ``data.path`` need not exist where the model is used). Silent about old keys."""
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), upgraded(values, origin)))
    except OmegaConfBaseException as err:
        raise _explain(err, origin) from None
    assert isinstance(cfg, Config)
    return _adopt_parallel(cfg)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file; pass a YAML file such as mesh_configs/cpu8.yaml")
    try:
        content = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML ({_one_line(err)})") from None
    if not isinstance(content, dict):
        sections = ", ".join(SECTIONS)
        raise ConfigError(f"--config {path}: expected a mapping of sections ({sections})")
    return content


def _parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or "." not in key or not key.strip():
            raise ConfigError(
                f"override {item!r}: expected section.key=value, e.g. parallel.tensor=4 or train.steps=20"
            )
    # YAML 1.1 reads an unquoted 3:4 as the base-60 number 184: keep step ranges as written. A value
    # that starts with * or & (a glob such as *attn*) would be read as a YAML alias or anchor, which a
    # command line never means: it is the text as written.
    # A list field given one value (train.lora.targets=*attn*) is a list of that one value.
    quoted = []
    for item in overrides:
        key, _, value = item.partition("=")
        as_text = key.strip() in _STRING_KEYS or value.lstrip().startswith(("*", "&"))
        if as_text and not value.startswith(("'", '"')):
            value = repr(value)
        if _is_list_field(key.strip()) and not value.lstrip().startswith("["):
            value = f"[{value}]"
        quoted.append(f"{key}={value}")
    try:
        values = OmegaConf.to_container(OmegaConf.from_dotlist(quoted), resolve=False)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {_failing_override(quoted)!r}: its value is not valid YAML ({_one_line(err)}); "
                          "check its brackets and quotes (a list is [a, b]; quote text YAML would read otherwise)") from None
    assert isinstance(values, dict)
    return values


_STRING_KEYS = ("train.profile_steps",)


def _is_list_field(key: str) -> bool:
    """Whether the dotted ``key`` names a field declared as a list (not an optional one)."""
    section: Any = Config
    *parents, name = key.split(".")
    for part in parents:
        found = {f.name: f for f in dataclasses.fields(section)}.get(part)
        section = found.default_factory if found is not None and callable(found.default_factory) else None
        if section is None or not dataclasses.is_dataclass(section):
            return False
    declared = {f.name: f.type for f in dataclasses.fields(section)}.get(name)
    return isinstance(declared, str) and declared.startswith("list[")


def _failing_override(overrides: list[str]) -> str:
    """The first override whose value YAML cannot read."""
    for item in overrides:
        try:
            yaml.safe_load(item.partition("=")[2])
        except yaml.YAMLError:
            return item
    return overrides[0]


def _one_line(err: Exception) -> str:
    """A YAML error's several lines (problem, marks, context) as one."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())[:300]


def _explain(err: OmegaConfBaseException, origin: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        section, _, name = str(key).rpartition(".")
        if not section:
            known = ", ".join(SECTIONS)
            return ConfigError(f"{key} ({origin}): unknown section; the sections are {known}")
        sections = {
            "parallel": ParallelConfig, "mesh": MeshConfig, "model": ModelConfig, "train": TrainConfig,
            "data": DataConfig,
            "pipeline": PipelineConfig, "optim": OptimConfig, "checkpoint": CheckpointConfig,
            "distributed": DistributedConfig,
        }
        section_cls = sections.get(section.split(".")[0], Config)
        for part in section.split(".")[1:]:  # a nested section (train.wandb, model.moe): its own keys
            inner = typing.get_type_hints(section_cls).get(part)
            if not dataclasses.is_dataclass(inner):
                break
            section_cls = inner
        known = ", ".join(f.name for f in dataclasses.fields(section_cls))
        return ConfigError(f"{key} ({origin}): unknown key {name!r} in section {section!r}; valid keys: {known}")
    if isinstance(err, ValidationError):
        value = getattr(err, "value", None)
        expected = getattr(err, "ref_type", None)
        type_name = "" if expected is None else f" ({getattr(expected, '__name__', expected)})"
        return ConfigError(
            f"{key} ({origin}): cannot use {value!r} here ({err.msg.splitlines()[0]}); "
            f"give a value of the field's type{type_name}"
        )
    return ConfigError(f"{key} ({origin}): {str(err).splitlines()[0]}")


def _need(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}")


def validate(cfg: Config) -> None:
    """Every field's own checks: its range, its choices, its type, the path it names. Not those that
    combine two features or depend on the mesh's sizes, nor the devices present: they are the run's
    (:func:`meshtron.run.check_features`, run by :func:`meshtron.run.resolve_run`)."""
    mesh = cfg.mesh
    sizes = {f"parallel.{axis}": getattr(mesh, axis) for axis in ("data", "pipe", "tensor", "context")}
    for name, size in sizes.items():
        _need(size == -1 or size >= 1, name, f"must be a positive size or -1 (the rest of the devices), got {size}")
    _need(list(sizes.values()).count(-1) <= 1, "parallel", "at most one of data, pipe, tensor, context may be -1")

    m = cfg.model
    for name in ("vocab_size", "hidden", "heads", "layers", "mlp_dim", "seq_len"):
        _need(getattr(m, name) >= 1, f"model.{name}", f"must be >= 1, got {getattr(m, name)}")
    _need(m.hidden % m.heads == 0, "model.hidden", f"{m.hidden} is not divisible by model.heads={m.heads}")
    for name in ("dtype", "param_dtype"):
        _need(getattr(m, name) in DTYPES, f"model.{name}", f"must be one of {DTYPES}, got {getattr(m, name)!r}")
    _need(m.remat in REMAT_MODES, "model.remat", f"must be one of {', '.join(REMAT_MODES)}, got {m.remat!r}")
    _need(isinstance(m.sequence_parallel, bool), "parallel.sequence_parallel",
          f"must be true or false, got {m.sequence_parallel!r}")
    _need(isinstance(m.collective_matmul, bool), "parallel.collective_matmul",
          f"must be true or false, got {m.collective_matmul!r}")
    _need(isinstance(m.gradient_accumulation_fusion, bool), "parallel.gradient_accumulation_fusion",
          f"must be true or false, got {m.gradient_accumulation_fusion!r}")
    _need(isinstance(m.cast_once, bool), "parallel.cast_once", f"must be true or false, got {m.cast_once!r}")
    _need(m.factory is not None or m.family in FAMILIES, "model.family",
          f"must be one of {', '.join(FAMILIES)} (or set model.factory=package.module:function), got {m.family!r}")
    if m.kv_heads is not None:
        _need(m.kv_heads >= 1 and m.heads % m.kv_heads == 0, "model.kv_heads",
              f"{m.kv_heads} must be >= 1 and divide model.heads={m.heads} (each key/value head serves a group "
              "of query heads)")
    _need(m.norm_eps > 0, "model.norm_eps", f"must be > 0 (the normalisation epsilon), got {m.norm_eps}")
    validate_moe(m)
    validate_mla(m)
    validate_mtp(m)
    if m.max_position_embeddings is not None:
        _need(m.max_position_embeddings >= m.seq_len, "model.max_position_embeddings",
              f"{m.max_position_embeddings} is shorter than model.seq_len={m.seq_len}: the training window must fit "
              "the model's positions; raise it or lower model.seq_len")
    _need(m.fp8 in FP8_RECIPES, "model.fp8",
          f"must be one of {', '.join(FP8_RECIPES)} (off: projections in model.dtype; current: FP8 GEMMs scaled "
          f"per tensor by its amax; delayed: by an amax history), got {m.fp8!r}")
    _need(isinstance(m.fp8_amax_history, int) and m.fp8_amax_history >= 1, "model.fp8_amax_history",
          f"must be a whole number of steps >= 1 (how many steps' amaxes delayed FP8 scaling takes the largest "
          f"of), got {m.fp8_amax_history!r}")
    _need(m.attention in ("xla", "cudnn"), "model.attention",
          f"must be 'xla' or 'cudnn' (cuDNN flash attention, GPUs only), got {m.attention!r}")
    _need(m.context_attention in CONTEXT_EXCHANGES, "parallel.context_attention",
          f"must be one of {', '.join(CONTEXT_EXCHANGES)} (how attention exchanges keys and values over "
          f"parallel.context), got {m.context_attention!r}")
    _need(isinstance(m.ulysses_degree, int) and not isinstance(m.ulysses_degree, bool) and m.ulysses_degree >= 1,
          "parallel.ulysses_degree", f"must be a whole number >= 1 (the context ranks the hybrid exchange's "
          f"all-to-alls join), got {m.ulysses_degree!r}")
    for name, axis in m.rules.items():
        _need(axis is None or axis in ("data", "pipe", "context", "tensor"), f"model.rules.{name}",
              f"{axis!r} is not a mesh axis; use data, pipe, context, tensor or null (replicated)")

    t = cfg.train
    for name in ("steps", "batch_size", "eval_every", "log_every", "eval_batches"):
        _need(getattr(t, name) >= 1, f"train.{name}", f"must be >= 1, got {getattr(t, name)}")
    _need(t.microbatches >= 1, "parallel.microbatches", f"must be >= 1, got {t.microbatches}")
    _need(t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    _need(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    _need(t.grad_clip is None or t.grad_clip >= 0, "train.grad_clip",
          "must be >= 0 (0 disables clipping) or null for the optimizer's default")
    _need(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
    _need(t.optimizer in OPTIMIZERS, "train.optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {t.optimizer!r}")
    for name in ("gather_dtype", "reduce_dtype"):
        _need(getattr(t, name) is None or getattr(t, name) in DTYPES, f"parallel.{name}",
              f"must be one of {DTYPES} or null, got {getattr(t, name)!r}")
    _need(t.zero in (0, 1, 3), "parallel.zero",
          f"must be 0 (replicated), 1 (optimizer state split over data) or 3 (parameters too), got {t.zero!r}")
    _need(
        t.batch_size % t.microbatches == 0,
        "train.batch_size",
        f"{t.batch_size} is not divisible by parallel.microbatches={t.microbatches}",
    )

    validate_lora(t.lora)
    validate_dpo(t)
    _need(t.on_nonfinite in ("stop", "skip"), "train.on_nonfinite", f"must be 'stop' or 'skip', got {t.on_nonfinite!r}")
    _need(t.max_skipped_steps >= 1, "train.max_skipped_steps", f"must be >= 1, got {t.max_skipped_steps}")
    _need(t.max_minutes is None or t.max_minutes > 0, "train.max_minutes",
          f"must be > 0 (minutes of wall-clock time) or null for no limit, got {t.max_minutes}")
    _need(t.peak_flops is None or t.peak_flops > 0, "train.peak_flops",
          f"must be > 0 (one device's peak FLOP/s) or null, got {t.peak_flops}")
    parse_profile_steps(t.profile_steps)
    check_output_path("train.tensorboard", t.tensorboard, directory=True)
    validate_trackers(t)
    if t.profile_steps:
        check_output_path("train.profile_dir", t.profile_dir, directory=True)

    _need(cfg.pipeline.chunks >= 1, "parallel.chunks", f"must be >= 1, got {cfg.pipeline.chunks}")
    validate_optim(cfg.optim)
    validate_checkpoint(cfg.checkpoint)
    validate_init(cfg)
    validate_distributed(cfg.distributed)
    validate_gpu(cfg.gpu)
    _need(0 < cfg.data.holdout_fraction < 1, "data.holdout_fraction", "must be between 0 and 1")
    _need(isinstance(cfg.data.pairs_per_window, int) and not isinstance(cfg.data.pairs_per_window, bool)
          and cfg.data.pairs_per_window >= 1, "data.pairs_per_window",
          f"must be a whole number >= 1 (1: one preference pair a window), got {cfg.data.pairs_per_window!r}")
    _need(cfg.data.path is None or cfg.data.blend is None, "data.blend",
          "give either data.path or data.blend, not both (a blend names its datasets itself)")
    _need(cfg.data.source in DATA_SOURCES, "data.source",
          f"must be one of {', '.join(DATA_SOURCES)}, got {cfg.data.source!r}")
    _need(isinstance(cfg.data.text_field, str) and bool(cfg.data.text_field), "data.text_field",
          f"must be a column name, got {cfg.data.text_field!r}")
    if cfg.data.source != "indexed":
        _need(cfg.data.path is not None or cfg.data.blend is not None, "data.path",
              f"data.source={cfg.data.source} reads a dataset: give its files or folder in data.path (or data.blend)")
        blended = list(cfg.data.blend)[1::2] if isinstance(cfg.data.blend, list) else []
        for path in ([cfg.data.path] if cfg.data.path is not None else blended):
            _need(Path(str(path)).exists(), "data.path" if cfg.data.path is not None else "data.blend",
                  f"{path!r} does not exist; give a local Parquet, JSON-lines{' or ArrayRecord' * (cfg.data.source == 'grain')} "
                  f"file or folder{' or a save_to_disk folder' * (cfg.data.source == 'hf')}")
    elif cfg.data.path is not None and indexed_prefix(cfg.data.path) is None:
        _need(not Path(cfg.data.path).is_dir(), "data.path",
              f"{cfg.data.path!r} is a directory; give a UTF-8 text file in it, or an indexed dataset's prefix")
        _need(
            Path(cfg.data.path).is_file(),
            "data.path",
            f"{cfg.data.path!r} does not exist; give a UTF-8 text file, an indexed dataset's prefix (PREFIX.bin "
            "+ PREFIX.idx, from meshtron preprocess) or leave data.path unset for the built-in corpus",
        )


def validate_gpu(gpu: GpuConfig) -> None:
    """``gpu.overlap`` is off or on; ``gpu.xla_flags`` parses as ``XLA_FLAGS`` (:mod:`meshtron.xla_options`)."""
    _need(gpu.xla_flags is None or isinstance(gpu.xla_flags, str), "gpu.xla_flags",
          f"must be a string of flags ('--name=value ...'), got {gpu.xla_flags!r}")
    compiler_options(gpu.overlap, gpu.xla_flags)


DATA_SOURCES = ("indexed", "hf", "grain")


def indexed_prefix(path: str) -> str | None:
    """The prefix of a Megatron-LM indexed dataset that ``path`` names (``PREFIX``, ``PREFIX.bin`` or
    ``PREFIX.idx``, with both files present), else None."""
    prefix = str(path)
    if prefix.endswith((".bin", ".idx")):
        prefix = prefix[:-4]
    return prefix if Path(prefix + ".idx").is_file() and Path(prefix + ".bin").is_file() else None


def parse_profile_steps(spec: str | None) -> tuple[int, int] | None:
    """``train.profile_steps``: ``"a:b"`` -> (a, b), trace steps a..b inclusive; None: no profile."""
    if spec is None or spec == "":
        return None
    try:
        first, last = (int(x) for x in str(spec).split(":"))
    except ValueError:
        raise ConfigError(f"train.profile_steps: expected FIRST:LAST step numbers such as 5:7, got {spec!r} (in a YAML "
                          "file quote it: profile_steps: '5:7'; unquoted, YAML reads 5:7 as the number 307)") from None
    if not 1 <= first <= last:
        raise ConfigError(f"train.profile_steps: need 1 <= FIRST <= LAST, got {spec!r}")
    return first, last


def validate_trackers(t: TrainConfig) -> None:
    """``train.trackers`` names known trackers once each, whose libraries are installed: a missing one is
    one line naming the extra, before anything runs (the library itself is imported when the run starts)."""
    _need(len(set(t.trackers)) == len(t.trackers), "train.trackers", f"names a tracker twice: {list(t.trackers)}")
    for name in t.trackers:
        _need(name in TRACKERS, "train.trackers", f"{name!r} is not a tracker; use {' or '.join(TRACKERS)}")
        _need(importlib.util.find_spec(name) is not None, "train.trackers",
              f"{name} is not installed; pip install 'meshtron[{name}]'")
    for name in ("project", "entity", "name"):
        value = getattr(t.wandb, name)
        _need(value is None or (isinstance(value, str) and value), f"train.wandb.{name}",
              f"must be a non-empty string or null, got {value!r}")
    _need(all(isinstance(tag, str) and tag for tag in t.wandb.tags), "train.wandb.tags",
          f"must be a list of non-empty strings, got {list(t.wandb.tags)!r}")
    for name in ("experiment", "run_name", "tracking_uri"):
        value = getattr(t.mlflow, name)
        _need(value is None or (isinstance(value, str) and value), f"train.mlflow.{name}",
              f"must be a non-empty string or null, got {value!r}")


def validate_dpo(t: TrainConfig) -> None:
    """``train.objective`` and ``train.dpo``'s settings, one line each."""
    _need(t.objective in OBJECTIVES, "train.objective", f"must be one of {', '.join(OBJECTIVES)}, got {t.objective!r}")
    d = t.dpo
    _need(isinstance(d.beta, int | float) and not isinstance(d.beta, bool) and d.beta > 0, "train.dpo.beta",
          f"must be > 0, got {d.beta!r}")
    _need(isinstance(d.label_smoothing, int | float) and 0 <= d.label_smoothing < 0.5, "train.dpo.label_smoothing",
          f"must be in [0, 0.5), got {d.label_smoothing!r}")
    _need(d.loss in DPO_LOSSES, "train.dpo.loss", f"must be one of {', '.join(DPO_LOSSES)}, got {d.loss!r}")
    _need(d.loss != "ipo" or d.label_smoothing == 0, "train.dpo.label_smoothing",
          "applies to the sigmoid loss only; set it to 0 with train.dpo.loss=ipo")


def validate_lora(lora: LoraConfig) -> None:
    """``train.lora``'s settings, one line each (the rest is checked when the adapters are made)."""
    _need(isinstance(lora.rank, int) and lora.rank >= 0, "train.lora.rank", f"must be an integer >= 0, got {lora.rank!r}")
    if lora.rank == 0:
        return
    _need(lora.alpha > 0, "train.lora.alpha", f"must be > 0, got {lora.alpha}")
    _need(0 <= lora.dropout < 1, "train.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
    _need(bool(lora.targets) and all(isinstance(x, str) and x for x in lora.targets), "train.lora.targets",
          "must be a non-empty list of path patterns or axis:NAME")


def validate_moe(m: ModelConfig) -> None:
    e = m.moe
    _need(e.experts >= 0, "model.moe.experts", f"must be >= 0 (0: a dense model), got {e.experts}")
    if not e.experts:
        return
    _need(m.factory is not None or m.family in ("llama", "deepseek"), "model.moe.experts",
          f"the {m.family} family has no mixture of experts; use model.family=llama or deepseek")
    _need(1 <= e.top_k <= e.experts, "model.moe.top_k", f"must be between 1 and model.moe.experts={e.experts}, got {e.top_k}")
    _need(e.mlp_dim is None or e.mlp_dim >= 1, "model.moe.mlp_dim", f"must be >= 1 or null, got {e.mlp_dim}")
    _need(e.capacity_factor >= 0, "model.moe.capacity_factor",
          f"must be >= 0 (0: dropless), got {e.capacity_factor}")
    for name in ("aux_loss_weight", "z_loss_weight"):
        _need(getattr(e, name) >= 0, f"model.moe.{name}", f"must be >= 0, got {getattr(e, name)}")
    _need(e.shared_experts >= 0, "model.moe.shared_experts", f"must be >= 0, got {e.shared_experts}")
    _need(e.router in ("softmax", "sigmoid"), "model.moe.router", f"must be softmax or sigmoid, got {e.router!r}")
    _need(e.routed_scaling_factor > 0, "model.moe.routed_scaling_factor",
          f"must be > 0, got {e.routed_scaling_factor}")
    _need(e.n_group >= 1 and e.experts % e.n_group == 0, "model.moe.n_group",
          f"must be >= 1 and divide model.moe.experts={e.experts}, got {e.n_group}")
    _need(e.n_group == 1 or e.experts // e.n_group >= 2, "model.moe.n_group",
          f"groups score their two best experts, so each needs >= 2; {e.experts} experts in {e.n_group} groups "
          "have 1: use fewer groups")
    kept = e.n_group if e.topk_group is None else e.topk_group
    _need(1 <= kept <= e.n_group, "model.moe.topk_group",
          f"must be between 1 and model.moe.n_group={e.n_group} (null: all), got {e.topk_group}")
    _need(e.top_k <= kept * (e.experts // e.n_group), "model.moe.topk_group",
          f"the {kept} kept groups hold {kept * (e.experts // e.n_group)} experts, fewer than model.moe.top_k="
          f"{e.top_k}; keep more groups")
    _need(e.bias_update_rate >= 0, "model.moe.bias_update_rate",
          f"must be >= 0 (0: no aux-loss-free balancing), got {e.bias_update_rate}")
    _need(isinstance(e.selection_bias, bool), "model.moe.selection_bias",
          f"must be true or false, got {e.selection_bias!r}")
    _need(e.sequence_aux_loss_weight >= 0, "model.moe.sequence_aux_loss_weight",
          f"must be >= 0, got {e.sequence_aux_loss_weight}")
    _need(e.dispatch in ("padded", "ragged"), "model.moe.dispatch", f"must be padded or ragged, got {e.dispatch!r}")
    _need(e.dispatch == "padded" or not e.capacity_factor, "model.moe.dispatch",
          f"ragged sends each expert its routed rows, so it needs dropless experts; set model.moe.capacity_factor=0 "
          f"(got {e.capacity_factor:g}) or model.moe.dispatch=padded")


def validate_mtp(m: ModelConfig) -> None:
    """``model.mtp``: multi-token prediction's depth and loss weight, for the deepseek family only."""
    t = m.mtp
    _need(isinstance(t.layers, int) and not isinstance(t.layers, bool) and t.layers >= 0, "model.mtp.layers",
          f"must be a whole number >= 0 (0: no multi-token prediction; DeepSeek-V3: 1), got {t.layers!r}")
    _need(isinstance(t.loss_weight, (int, float)) and not isinstance(t.loss_weight, bool) and t.loss_weight >= 0,
          "model.mtp.loss_weight", f"must be a number >= 0 (DeepSeek-V3: 0.3, later 0.1), got {t.loss_weight!r}")
    _need(t.layers == 0 or (m.factory is None and m.family == "deepseek"), "model.mtp.layers",
          f"multi-token prediction is built by the deepseek family only, got "
          f"{'model.factory' if m.factory is not None else 'family ' + repr(m.family)}; set model.mtp.layers=0")
    _need(t.layers < m.seq_len, "model.mtp.layers",
          f"{t.layers} depths predict past a model.seq_len={m.seq_len} window: every target would fall off it; "
          "lower it or lengthen the window")


YARN_KEYS = ("type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate")
"""The keys of ``model.rope_scaling`` (Hugging Face's YaRN parameters; ``type`` and ``rope_type`` are synonyms)."""


def validate_mla(m: ModelConfig) -> None:
    """``model.mla``, ``model.rope_scaling`` and ``model.first_k_dense_replace``: the deepseek family's fields."""
    deepseek = m.factory is None and m.family == "deepseek"
    a = m.mla
    if deepseek:
        _need(a.q_lora_rank is None or a.q_lora_rank >= 1, "model.mla.q_lora_rank",
              f"must be >= 1, or null for a direct query projection, got {a.q_lora_rank}")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _need(getattr(a, name) >= 1, f"model.mla.{name}", f"must be >= 1, got {getattr(a, name)}")
        _need(a.qk_rope_head_dim >= 2 and a.qk_rope_head_dim % 2 == 0, "model.mla.qk_rope_head_dim",
              f"must be even and >= 2 (rotary features turn in pairs), got {a.qk_rope_head_dim}")
        _need(isinstance(a.rope_interleave, bool), "model.mla.rope_interleave",
              f"must be true or false, got {a.rope_interleave!r}")
        _need(m.kv_heads is None, "model.kv_heads",
              "the deepseek family has no key/value heads of its own (keys and values come from one latent); "
              "leave it null")
    _need(0 <= m.first_k_dense_replace <= m.layers, "model.first_k_dense_replace",
          f"must be between 0 and model.layers={m.layers}, got {m.first_k_dense_replace}")
    _need(m.first_k_dense_replace == 0 or deepseek, "model.first_k_dense_replace",
          f"only the deepseek family has dense blocks before its mixture-of-experts ones; got family {m.family!r}")
    r = m.rope_scaling
    if r is None:
        return
    _need(deepseek, "model.rope_scaling", f"only the deepseek family scales its rotary positions (YaRN); "
          f"got family {m.family!r}: set it to null")
    unknown = sorted(set(r) - set(YARN_KEYS))
    _need(not unknown, f"model.rope_scaling.{unknown[0] if unknown else ''}",
          f"not a YaRN parameter; use {', '.join(YARN_KEYS)}")
    kind = r.get("rope_type", r.get("type"))
    _need(kind == "yarn", "model.rope_scaling.type", f"must be 'yarn' (the only rotary scaling the deepseek family "
          f"has), got {kind!r}")
    factor = r.get("factor")
    _need(isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor >= 1,
          "model.rope_scaling.factor", f"must be a number >= 1 (how much longer the context is), got {factor!r}")
    original = r.get("original_max_position_embeddings")
    _need(isinstance(original, int) and not isinstance(original, bool) and original >= 1,
          "model.rope_scaling.original_max_position_embeddings",
          f"must be the pretraining context length (an int >= 1), got {original!r}")
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        value = r.get(name)
        _need(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0),
              f"model.rope_scaling.{name}", f"must be a number >= 0 or absent, got {value!r}")
    _need(isinstance(r.get("truncate", True), bool), "model.rope_scaling.truncate",
          f"must be true or false, got {r.get('truncate')!r}")


def validate_optim(o: OptimConfig) -> None:
    for name in ("b1", "b2"):
        value = getattr(o, name)
        _need(value is None or 0 <= value < 1, f"optim.{name}", f"must be in [0, 1), got {value}")
    _need(o.eps is None or o.eps >= 0, "optim.eps", f"must be >= 0, got {o.eps}")
    _need(
        o.freeze_step is None or o.freeze_step >= 1,
        "optim.freeze_step",
        f"must be >= 1 (uncompressed warmup steps) or null for 16% of train.steps, got {o.freeze_step}",
    )
    _need(0 < o.min_coeff <= o.max_coeff, "optim.min_coeff",
          f"need 0 < optim.min_coeff <= optim.max_coeff, got {o.min_coeff} and {o.max_coeff}")
    _need(0 <= o.coeff_beta < 1, "optim.coeff_beta", f"must be in [0, 1), got {o.coeff_beta}")
    _need(0 < o.factor_min <= o.factor_max, "optim.factor_min",
          f"need 0 < optim.factor_min <= optim.factor_max, got {o.factor_min} and {o.factor_max}")
    _need(o.factor_threshold >= 0, "optim.factor_threshold", f"must be >= 0, got {o.factor_threshold}")


def check_output_path(field_name: str, path: str | os.PathLike | None, *, directory: bool) -> None:
    """A path a run or a tool will write -- a directory (``directory``) or a file -- must not already be
    the other kind, nor lie under a file; one line naming the field otherwise, before anything runs."""
    if path is None:
        return
    target = Path(path)
    if directory and target.exists() and not target.is_dir():
        raise ConfigError(f"{field_name}: {os.fspath(path)!r} is a file; give a directory (it is created if missing)")
    if not directory and target.is_dir():
        raise ConfigError(f"{field_name}: {os.fspath(path)!r} is a directory; give a file's path")
    for parent in target.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{field_name}: {os.fspath(path)!r} cannot be created: {parent} is a file")
            break


def validate_checkpoint(c: CheckpointConfig) -> None:
    _need(c.every >= 1, "checkpoint.every", f"must be >= 1 (steps between saves), got {c.every}")
    _need(c.keep >= 1, "checkpoint.keep", f"must be >= 1 (checkpoints kept), got {c.keep}")
    _need(c.onebit_errors in ("keep", "reset"), "checkpoint.onebit_errors",
          f"must be 'keep' or 'reset', got {c.onebit_errors!r}")
    check_output_path("checkpoint.dir", c.dir, directory=True)


def validate_init(cfg: Config) -> None:
    """``train.init_from`` names an existing checkpoint directory that is not the run's own."""
    t = cfg.train
    _need(isinstance(t.init_optimizer, bool), "train.init_optimizer", f"must be true or false, got {t.init_optimizer!r}")
    if t.init_from is None:
        _need(not t.init_optimizer, "train.init_optimizer",
              "takes the optimizer state of train.init_from, which is not set; set train.init_from or remove it")
        return
    path = Path(t.init_from)
    _need(path.is_dir(), "train.init_from",
          f"{t.init_from!r} is not a directory; give a checkpoint directory (a run's checkpoint.dir, an import) "
          "or one of its step directories")
    own = cfg.checkpoint.dir
    if own is not None and path.resolve() == Path(own).resolve():
        step = imported_step(own)
        if step is not None:
            raise writing_into_an_import(own, step)
        raise ConfigError(f"train.init_from: {t.init_from!r} is this run's checkpoint.dir: a run resumes from its own "
                          "checkpoints by itself; remove train.init_from to continue that run, or set a new "
                          "checkpoint.dir to start one from it")


def writing_into_an_import(directory: str, step: int) -> ConfigError:
    """The error for a ``checkpoint.dir`` that holds an imported model: a run never writes into one."""
    return ConfigError(f"checkpoint.dir: {directory} holds an imported model (step {step}), which a run never writes "
                       f"into; start from it with train.init_from={directory} and give the new run its own "
                       "checkpoint.dir")


def validate_distributed(d: DistributedConfig) -> None:
    if d.coordinator_address is not None:
        host, sep, port = d.coordinator_address.rpartition(":")
        _need(bool(sep and host and port.isdigit()), "distributed.coordinator_address",
              f"expected host:port (e.g. 10.0.0.1:1234), got {d.coordinator_address!r}")
    _need(d.num_processes is None or d.num_processes >= 1, "distributed.num_processes",
          f"must be >= 1, got {d.num_processes}")
    if d.process_id is not None:
        _need(d.process_id >= 0, "distributed.process_id", f"must be >= 0, got {d.process_id}")
        _need(d.num_processes is None or d.process_id < d.num_processes, "distributed.process_id",
              f"{d.process_id} is not below distributed.num_processes={d.num_processes}; ids run from 0")
    _need(d.local_devices is None or d.local_devices >= 1, "distributed.local_devices",
          f"must be >= 1, got {d.local_devices}")
    _need(d.initialization_timeout >= 1, "distributed.initialization_timeout", "must be >= 1 second")
    _need(d.heartbeat_timeout >= 1, "distributed.heartbeat_timeout", "must be >= 1 second")


def freeze_step(cfg: Config) -> int:
    """1-bit LAMB's warmup length: ``optim.freeze_step``, or 16% of ``train.steps`` (at least 1)."""
    if cfg.optim.freeze_step is not None:
        return cfg.optim.freeze_step
    return max(1, round(0.16 * cfg.train.steps))


def padded_vocab_size(vocab_size: int, tensor: int, multiple: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x tensor so every shard is equal and aligned."""
    step = multiple * tensor
    return int(math.ceil(vocab_size / step) * step)


def to_dict(cfg: Config) -> dict:
    """``cfg`` as users write it: the ``parallel`` section, not the old sections' copies of it (no
    ``mesh`` or ``pipeline`` section); what ``--print-config`` shows and checkpoints record."""
    values = dataclasses.asdict(cfg)
    for old in ALIASES:
        section, _, name = old.partition(".")
        del values[section][name]
    return {key: value for key, value in values.items() if value != {} or key not in ("mesh", "pipeline")}
