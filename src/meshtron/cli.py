"""``meshtron train | describe | generate | eval | launch | schedule | plan | configs | tokenizer | preprocess |
plot | import-hf | export-hf``: the command line.

The config is read and validated *before* JAX is imported, so that on a CPU-only machine the CLI
can still ask XLA for as many simulated host devices as the mesh needs (appending to any
``XLA_FLAGS`` the user set, never replacing them). Bad input ends in one line naming the field
and the fix, with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from meshtron.bundled_configs import bundled, natural_order
from meshtron.config import (
    Config,
    MeshConfig,
    check_output_path,
    config_from_dict,
    load_config,
    note_deprecated,
    to_dict,
    upgraded,
)
from meshtron.distributed import ProcessGroup, resolve_group
from meshtron.errors import EXIT_STOPPED, CheckpointError, ConfigError, NonFiniteLossError, RunStopped
from meshtron.gpu.targets import TARGETS as GPU_TARGETS
from meshtron.gpu.targets import prepare_environment
from meshtron.mesh import MAX_SIMULATED_DEVICES, devices_requested, ensure_cpu_devices, mesh_shape
from meshtron.models.registry import hf_mapping
from meshtron.run import Run, check_features, resolve_run
from meshtron.units import format_count


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshtron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE|NAME",
                        help="a YAML file, or a bundled config's name (e.g. cpu8, paper/gpt_1t: meshtron configs)")
    common.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. parallel.tensor=4")
    train = sub.add_parser("train", parents=[common], help="train a GPT on the mesh")
    train.add_argument("--metrics", metavar="FILE.jsonl", help="write one JSON line per logged step")
    train.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files there (train.tensorboard)")
    train.add_argument("--print-config", action="store_true",
                       help="print the merged, validated config as YAML and exit (no training)")
    describe = sub.add_parser("describe", parents=[common], help="mesh, parameter layout and the compiled step's collectives")
    describe.add_argument("--compile", action="store_true",
                          help="compile the train step for the mesh from abstract arrays even when the run would not "
                               "fit this machine (nothing is allocated): compiled memory per device and collectives")
    describe.add_argument("--target", choices=sorted(GPU_TARGETS), metavar="GPU",
                          help="compile for GPUs of this kind (h100, h200, a100; as many as the mesh names) without "
                               "having them: the GPU program's memory, collectives, overlap and estimated step time "
                               "(needs the gpu-compile extra)")
    launch = sub.add_parser("launch", parents=[common], help="train in N local processes (one distributed run)")
    launch.add_argument("--processes", type=int, required=True, metavar="N")
    launch.add_argument("--metrics", metavar="FILE.jsonl", help="written by process 0")
    launch.add_argument("--tensorboard", metavar="DIR", help="written by process 0 (train.tensorboard)")
    gen = sub.add_parser("generate", help="sample text from a checkpoint, on any mesh")
    gen.add_argument("checkpoint", nargs="?", metavar="CKPT",
                     help="a run's checkpoint.dir or an import (newest intact step); or --checkpoint CKPT")
    gen.add_argument("--checkpoint", dest="checkpoint_flag", metavar="CKPT", help="the same as CKPT")
    gen.add_argument("--prompt", required=True, metavar="TEXT")
    gen.add_argument("--chat", action="store_true",
                     help="TEXT is a user's message: apply the chat template the SFT data was rendered with, print "
                          "the answer alone")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="write --max-tokens tokens (default: stop at the end-of-text token or the end of an answer)")
    gen.add_argument("--max-tokens", type=int, default=200, metavar="N", help="new tokens to generate (default 200)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("overrides", nargs="*", metavar="mesh.key=value",
                     help="the mesh to sample on, e.g. parallel.tensor=4 (default: the mesh that trained it)")
    ev = sub.add_parser("eval", help="score a checkpoint on lm-evaluation-harness tasks, on any mesh (the eval extra)")
    ev.add_argument("checkpoint", nargs="?", metavar="CKPT",
                    help="a run's checkpoint.dir or an import (newest intact step); or --checkpoint CKPT")
    ev.add_argument("--checkpoint", dest="checkpoint_flag", metavar="CKPT", help="the same as CKPT")
    ev.add_argument("--tasks", required=True, metavar="A,B", help="lm-eval task names, comma-separated")
    ev.add_argument("--include-path", metavar="DIR", help="a directory of your own task YAMLs (searched too)")
    ev.add_argument("--batch-size", type=int, default=8, metavar="N", help="requests per device call (default 8)")
    ev.add_argument("--limit", type=float, metavar="N",
                    help="score only the first N examples of each task (below 1: that fraction)")
    ev.add_argument("--num-fewshot", type=int, metavar="K", help="examples in each prompt (default: the task's)")
    ev.add_argument("--max-gen-tokens", type=int, default=256, metavar="N",
                    help="new tokens of a generation task that does not say (default 256)")
    ev.add_argument("--gen-kwargs", metavar="K=V,K=V",
                    help="override every generation task's generation_kwargs, as lm-eval's --gen_kwargs "
                         "(e.g. do_sample=True,temperature=0.8,top_p=0.95)")
    ev.add_argument("--seed", default="0,1234,1234,1234", metavar="S|P,N,T,F",
                    help="lm-eval's seeds: one for all, or python,numpy,sampling,fewshot (None: unset; sampling "
                         "unset: a fresh seed); sampled generation draws from the third (default 0,1234,1234,1234)")
    ev.add_argument("--output", metavar="FILE.json", help="write lm-eval's results JSON there (a new file)")
    ev.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    ev.add_argument("overrides", nargs="*", metavar="mesh.key=value",
                    help="the mesh to evaluate on, e.g. parallel.tensor=4 (default: the mesh that trained it)")
    sub.add_parser("configs", help="list the bundled configs: names for --config, mesh and model size")
    tok = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (Hugging Face tokenizers) on text files")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_sub.add_parser("train", help="train a byte-level BPE and save it as tokenizer.json")
    tok_train.add_argument("--input", nargs="+", required=True, metavar="FILE", help="UTF-8 text files")
    tok_train.add_argument("--vocab-size", type=int, required=True, metavar="N")
    tok_train.add_argument("--output", required=True, metavar="tokenizer.json")
    tok_train.add_argument("--min-frequency", type=int, default=2, metavar="K", help="merge pairs seen K times (2)")
    pre = sub.add_parser("preprocess", help="tokenize text or JSON lines into a Megatron-LM indexed dataset")
    pre.add_argument("--input", nargs="+", required=True, metavar="FILES",
                     help="text files (one document each) or .jsonl/.json (one document per line); globs allowed")
    pre.add_argument("--tokenizer", required=True, metavar="T", help="bytes, a tokenizer.json or a SentencePiece .model")
    pre.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    pre.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes (default 1)")
    pre.add_argument("--json-key", default="text", metavar="KEY", help="the text field of a JSON line (text)")
    pre.add_argument("--no-eod", action="store_true",
                     help="do not append the end-of-document token (--sft: do not end answers with it, so the "
                          "model does not learn to stop)")
    pre.add_argument("--sft", action="store_true",
                     help="supervised fine-tuning examples: JSON lines of {prompt, response} or {messages: [...]}, "
                          "rendered with the chat template; also writes PREFIX.loss_mask.bin/.idx (answers only)")
    pre.add_argument("--preference", action="store_true",
                     help="preference pairs for train.objective=dpo: JSON lines of {prompt, chosen, rejected} "
                          "(strings or chat messages), rendered with the chat template; two documents per pair "
                          "and PREFIX.loss_mask.bin/.idx (answers only)")
    plot = sub.add_parser("plot", help="draw train and held-out loss curves of runs (--metrics files) into a PNG")
    plot.add_argument("metrics", nargs="+", metavar="METRICS.jsonl")
    plot.add_argument("--output", default="loss.png", metavar="FILE.png", help="(default loss.png)")
    plot.add_argument("--per-byte", action="store_true",
                      help="held-out loss in nats per byte of text (compares runs with different tokenizers)")
    imp = sub.add_parser("import-hf", help="a Hugging Face Llama (Mistral-as-Llama), Mixtral or GPT-2 checkpoint -> a "
                                           "meshtron checkpoint")
    imp.add_argument("directory", metavar="HF_DIR", help="config.json + *.safetensors (+ tokenizer.json)")
    imp.add_argument("--output", required=True, metavar="CKPT", help="a new (or empty) checkpoint directory")
    imp.add_argument("overrides", nargs="*", metavar="section.key=value",
                     help="settings of the recorded run, e.g. train.optimizer=lamb model.seq_len=8192")
    exp = sub.add_parser("export-hf", help="a meshtron Llama, Mixtral or GPT checkpoint -> a Hugging Face directory "
                                           "(safetensors)")
    exp.add_argument("checkpoint", metavar="CKPT", help="a run's checkpoint.dir (newest intact step)")
    exp.add_argument("--output", required=True, metavar="HF_DIR", help="a new (or empty) directory, outside CKPT")
    sched = sub.add_parser("schedule", help="print a pipeline schedule's table and checker report, draw it as a PNG")
    sched.add_argument("name", metavar="NAME", help="gpipe, 1f1b, interleaved, 1f1b-p or zb-h1, or a PyTorch action "
                       "CSV (torch.distributed.pipelining's _dump_csv: one row of actions per rank)")
    sched.add_argument("--pipe", type=int, metavar="P", help="pipeline stages (a CSV has its own)")
    sched.add_argument("--microbatches", type=int, metavar="M", help="(a CSV has its own)")
    sched.add_argument("--chunks", type=int, default=None, metavar="V",
                       help="model chunks per stage (interleaved; default 1; a CSV has its own)")
    sched.add_argument("--csv", metavar="FILE", help="also write the table as a PyTorch action CSV (_load_csv reads it)")
    sched.add_argument("--costs", default="1,1,1", metavar="F,B,W[,R]",
                       help="unit costs t_F,t_B,t_W (an unsplit backward costs t_B + t_W; default 1,1,1) and "
                            "optionally t_R, a backward's recomputation of its stage forward (default 0)")
    sched.add_argument("--png", metavar="FILE", help="where to draw the timeline (default: NAME-pP-mM-vV.png)")
    plan = sub.add_parser("plan", help="rank 3D layouts of a model on a GPU cluster by predicted throughput "
                          "(the PTD-P paper's model; no devices)")
    plan.add_argument("--config", required=True, metavar="FILE|NAME",
                      help="the model: a YAML file or a bundled config (e.g. paper/gpt_1t); its mesh is ignored")
    plan.add_argument("--gpus", type=int, required=True, metavar="N")
    plan.add_argument("--cluster", default=None, metavar="NAME|FILE",
                      help="a100-80gb (default; with --target, the target's), h100-80gb, h200-141gb, a100-ethernet, "
                           "or a cluster YAML of your own")
    plan.add_argument("--batch", type=int, metavar="B", help="global batch in sequences (default: train.batch_size)")
    plan.add_argument("--optimizer", choices=("adamw", "lamb", "onebit_lamb"),
                      help="the optimizer whose memory and exchange the ranking prices (default: train.optimizer)")
    plan.add_argument("--recompute", default="full,selective,none", metavar="MODES",
                      help="activation recomputation modes to consider (default full,selective,none)")
    plan.add_argument("--overlap-data", action="store_true",
                      help="assume the data-parallel all-reduce is hidden behind the backward")
    plan.add_argument("--gradients", default="fp32", choices=("fp32", "16bit", "sc21"),
                      help="how gradients are kept and all-reduced: fp32 (default), 16bit, or sc21 (the PTD-P "
                           "paper's Megatron-LM runs: fp16, the optimizer's fp32 copy, torch DDP without pipelining)")
    plan.add_argument("--zero", type=int, choices=(0, 1, 3),
                      help="split over data: 1 the optimizer state (Megatron's distributed optimizer), 3 the weights "
                           "and gradients too (fully sharded); 1-bit LAMB is priced at 0 (default: parallel.zero)")
    plan.add_argument("--context", type=int, metavar="C",
                      help="split every sequence over C context ranks in every layout (default: the config's "
                           "parallel.context)")
    plan.add_argument("--top", type=int, default=10, metavar="K", help="layouts to print (default 10)")
    plan.add_argument("--target", choices=sorted(GPU_TARGETS), metavar="GPU",
                      help="also compile the best --compile-top layouts for GPUs of this kind (h100, h200, a100; the "
                           "gpu-compile extra) and price them from their programs; the cluster defaults to the target's")
    plan.add_argument("--compile-top", type=int, default=3, metavar="K",
                      help="with --target: how many of the best layouts to compile (default 3)")
    plan.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. model.layers=64")
    return parser


# ---- meshtron configs ---------------------------------------------------------------------------


def _read_bundled(name: str, source: Traversable) -> Config:
    """A bundled config as a :class:`Config` (type-checked; not validated against this machine)."""
    try:
        values = yaml.safe_load(source.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"bundled config {name}: not valid YAML ({err})") from None
    return config_from_dict(values, f"bundled config {name}")


def _devices(mesh: MeshConfig) -> int:
    """The mesh's device count; 0 when an axis is -1 ("the rest of the devices")."""
    sizes = mesh_shape(mesh)
    return math.prod(sizes) if min(sizes) >= 1 else 0


def _summary(cfg: Config) -> str:
    """One line about a config: its mesh, and the model's family, size (its Hugging Face tensors, counted
    without JAX) and shape."""
    mesh, m = cfg.mesh, cfg.model
    sizes = {"data": mesh.data, "pipe": mesh.pipe, "tensor": mesh.tensor}
    if mesh.context != 1:
        sizes["context"] = mesh.context
    layout = " x ".join(f"{axis} {'rest' if size == -1 else size}" for axis, size in sizes.items())
    if _devices(mesh):
        layout += f" = {_devices(mesh)} devices"
    if m.factory is not None:
        return f"{layout}; model from {m.factory}: seq {m.seq_len}, {m.dtype}"
    mapping = hf_mapping(m.family)
    params = sum(math.prod(spec.hf_shape) * (sum(map(spec.stored_in, range(m.layers))) if spec.per_layer else 1)
                 * (m.moe.experts if spec.per_expert else 1) for spec in mapping.tensors(m))
    kv = f" ({m.kv_heads or m.heads} kv)" if mapping.GROUPED_QUERY else ""
    return (f"{layout}; {mapping.DISPLAY_NAME} {format_count(params)} params: {m.layers} layers, hidden {m.hidden}, "
            f"{m.heads} heads{kv}, seq {m.seq_len}, {m.dtype}")


def _listing() -> list[str]:
    """``meshtron configs``: one line per bundled config (name and :func:`_summary`), smallest mesh first
    within a directory."""
    configs = {name: _read_bundled(name, source) for name, source in bundled().items()}
    order = sorted(configs, key=lambda name: (name.count("/"), _devices(configs[name].mesh), natural_order(name)))
    width = max((len(name) for name in configs), default=0)
    return [f"{name:<{width}}  {_summary(configs[name])}" for name in order]


def _plan(args: argparse.Namespace) -> None:
    """``meshtron plan``: the paper's performance model over every layout; no devices, no JAX."""
    from meshtron.config import freeze_step
    from meshtron.plan import ModelShape, load_cluster
    from meshtron.plan.model import GRADIENTS, RECOMPUTE, context_exchange_of
    from meshtron.plan.report import make_plan, render

    # The model and batch come from the config; its mesh is what the plan chooses, so it is reset
    # before validation (a preset's 3072-GPU mesh must not reject a model override).
    # (sequence parallelism and the zero level are the config's, read before they are reset with it)
    layout_free = ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.context=1",
                   "parallel.microbatches=1", "parallel.chunks=1", "parallel.layout=null",
                   "parallel.sequence_parallel=false", "parallel.zero=0", "parallel.gather_once=false"]
    configured = load_config(args.config, args.overrides)
    context = args.context if args.context is not None else configured.mesh.context
    cfg = load_config(args.config, args.overrides, fixed=layout_free, notes=args.context is not None)
    check_features(cfg)
    modes = tuple(mode.strip() for mode in args.recompute.split(",") if mode.strip())
    unknown = [mode for mode in modes if mode not in RECOMPUTE]
    if unknown or not modes:
        raise ConfigError(f"--recompute: expected a comma-separated subset of {','.join(RECOMPUTE)}, "
                          f"got {args.recompute!r}")
    if args.top < 1:
        raise ConfigError(f"--top: must be >= 1, got {args.top}")
    optimizer = args.optimizer or cfg.train.optimizer
    batch = args.batch if args.batch is not None else cfg.train.batch_size
    gradients = GRADIENTS[args.gradients]
    if args.overlap_data:
        gradients = dataclasses.replace(gradients, overlap="always")
    zero = args.zero if args.zero is not None else configured.train.zero
    if zero:
        gradients = dataclasses.replace(gradients, zero=zero)
    if args.compile_top < 1:
        raise ConfigError(f"--compile-top: must be >= 1, got {args.compile_top}")
    cluster = args.cluster or (GPU_TARGETS[args.target].cluster if args.target else "a100-80gb")
    plan = make_plan(ModelShape.from_config(cfg.model), args.gpus, batch,
                     load_cluster(cluster), optimizer, modes,
                     freeze_fraction=min(1.0, freeze_step(cfg) / max(cfg.train.steps, 1)), gradients=gradients,
                     context=context, sequence_parallel=configured.model.sequence_parallel,
                     **context_exchange_of(configured.model))
    print(render(plan, args.top))
    if args.target:
        from meshtron.plan_on_target import price_on_target, priced_json, render_priced

        prepare_environment()
        priced = price_on_target(args.config, args.overrides, plan.result.ranked[:args.compile_top], args.target,
                                 zero or 0)
        print(render_priced(priced, args.target))
    if args.json:
        written = plan.to_dict(args.top)
        if args.target:
            written["compiled"] = {"target": args.target, "layouts": priced_json(priced)}
        Path(args.json).write_text(json.dumps(written, indent=2) + "\n")
        print(f"\njson      {args.json}")


def _schedule(args: argparse.Namespace) -> None:
    """``meshtron schedule``: no devices, no JAX."""
    from meshtron.pipeline.report import draw, text_report
    from meshtron.pipeline.schedules import Costs, ScheduleError, is_schedule_file, make_schedule

    try:
        costs = Costs(*(float(c) for c in args.costs.split(",")))
    except (TypeError, ValueError):
        raise ConfigError(f"--costs: expected three or four numbers t_F,t_B,t_W[,t_R] such as 1,1,1, "
                          f"got {args.costs!r}") from None
    if min(costs.forward, costs.backward, costs.weight, costs.recompute) < 0:
        raise ConfigError(f"--costs: costs cannot be negative, got {args.costs!r}")
    if not is_schedule_file(args.name):
        for flag, value in (("--pipe", args.pipe), ("--microbatches", args.microbatches)):
            if value is None:
                raise ConfigError(f"{flag}: required for the built-in schedule {args.name!r}")
    try:
        schedule = make_schedule(args.name, args.pipe, args.microbatches,
                                 args.chunks if args.chunks is not None or is_schedule_file(args.name) else 1)
    except ScheduleError as err:
        raise ConfigError(str(err)) from None
    text, _ = text_report(schedule, costs)
    print(text)
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    png = args.png or f"{Path(args.name).stem}-p{p}-m{m}-v{v}.png"
    print(f"timeline             {draw(schedule, png, costs)}")
    if args.csv:
        from meshtron.pipeline.torch_actions import from_schedule, write_csv

        write_csv(from_schedule(schedule), args.csv)
        print(f"torch actions        {args.csv}")


def _tokenizer(args: argparse.Namespace) -> None:
    """``meshtron tokenizer train``: no devices, no JAX."""
    from meshtron.data.tokenizers import train_bpe

    if args.vocab_size < 1:
        raise ConfigError(f"--vocab-size: must be a positive number of ids, got {args.vocab_size}")
    tok = train_bpe(args.input, args.vocab_size, args.output, min_frequency=args.min_frequency)
    print(f"tokenizer {args.output}: byte-level BPE, {tok.vocab_size} ids, end of document <|endoftext|> = {tok.eod}")


def _preprocess(args: argparse.Namespace) -> None:
    """``meshtron preprocess``: text -> Megatron-LM's ``.bin``/``.idx``."""
    from meshtron.data.preprocess import preprocess

    if args.workers < 1:
        raise ConfigError(f"--workers: must be >= 1, got {args.workers}")
    if args.sft and args.preference:
        raise ConfigError("--preference: and --sft are two kinds of data; give one (pairs for DPO: --preference)")
    if args.preference:
        from meshtron.data.preference import preprocess_preference

        preprocess_preference(args.input, args.tokenizer, args.output, append_eod=not args.no_eod, progress=True)
        return
    if args.sft:
        from meshtron.data.sft import preprocess_sft

        preprocess_sft(args.input, args.tokenizer, args.output, append_eod=not args.no_eod, progress=True)
        return
    preprocess(args.input, args.tokenizer, args.output, workers=args.workers, json_key=args.json_key,
               append_eod=not args.no_eod, progress=True)


def _plot(args: argparse.Namespace) -> None:
    from meshtron.train.reporting import plot_runs

    print(f"plot {plot_runs(args.metrics, args.output, per_byte=args.per_byte)}")


def _import_hf(args: argparse.Namespace) -> None:
    from meshtron.huggingface import FINETUNE_SUFFIX, import_hf

    out = import_hf(args.directory, args.output, overrides=args.overrides, argument="--output")
    print(f"checkpoint {out} (step 0, parameters); fine-tune it: meshtron train --config {out / 'config.yaml'} "
          f"data.path=... (starts from it, saves to {out}{FINETUNE_SUFFIX}: checkpoint.dir= chooses another)")


def _export_hf(args: argparse.Namespace) -> None:
    from meshtron.huggingface import export_hf

    print(f"hugging face model {export_hf(args.checkpoint, args.output, argument='--output')}")


_TOOLS = {"plan": _plan, "tokenizer": _tokenizer, "preprocess": _preprocess, "plot": _plot, "import-hf": _import_hf,
          "export-hf": _export_hf}


def _saved_mesh(directory: str) -> MeshConfig:
    """The mesh recorded by the newest checkpoint, read as plain JSON (before JAX starts, so the CPU
    device count can still be set); the default mesh if it cannot be read."""
    from meshtron.checkpoint_dirs import read_step_meta, step_directories

    for step in reversed(step_directories(directory)):
        try:
            saved = upgraded(read_step_meta(directory, step)["config"])["parallel"]
            return MeshConfig(**{axis: saved[axis] for axis in ("data", "pipe", "tensor", "context") if axis in saved})
        except (KeyError, TypeError, AttributeError, ConfigError):
            continue
    return MeshConfig()


def _generation_mesh(args: argparse.Namespace) -> MeshConfig:
    mesh = _saved_mesh(args.checkpoint)
    old = []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        section, _, name = key.partition(".")
        if section == "mesh" and key not in old:  # the old spelling
            old.append(key)
        if not sep or section not in ("parallel", "mesh") or name not in ("data", "pipe", "tensor"):
            raise ConfigError(f"override {item!r}: {args.command} takes parallel.data=, parallel.pipe= or parallel.tensor= "
                              "only")
        try:
            setattr(mesh, name, int(value))
        except ValueError:
            raise ConfigError(f"{key}: expected an integer size, got {value!r}") from None
    note_deprecated(old)
    mesh.context = 1  # decoding does not split sequences: a context-parallel run's checkpoint samples without it
    return mesh


def _generation_checkpoint(args: argparse.Namespace) -> None:
    """``generate CKPT`` or ``generate --checkpoint CKPT`` (exactly one), its mesh overrides anywhere."""
    if args.checkpoint is not None and _is_override(args.checkpoint):  # an override where CKPT may stand
        args.overrides.insert(0, args.checkpoint)
        args.checkpoint = None
    given = [c for c in (args.checkpoint, args.checkpoint_flag) if c is not None]
    if len(given) != 1:
        usage = "--prompt TEXT" if args.command == "generate" else "--tasks A,B"
        raise ConfigError(f"{args.command}: give the checkpoint once, as meshtron {args.command} CKPT {usage} (or "
                          f"--checkpoint CKPT){'' if not given else f'; got {given[0]!r} and {given[1]!r}'}")
    args.checkpoint_name = "--checkpoint" if args.checkpoint_flag is not None else "checkpoint"
    args.checkpoint = given[0]


def _generate(args: argparse.Namespace) -> None:
    _generation_checkpoint(args)
    mesh = _generation_mesh(args)
    needed = devices_requested(mesh)
    if needed <= MAX_SIMULATED_DEVICES:
        ensure_cpu_devices(needed)
    from meshtron.data.sft import ChatTemplate
    from meshtron.generate import sample
    from meshtron.pretrained import load_pretrained

    model = load_pretrained(args.checkpoint, mesh, argument=args.checkpoint_name)
    prompt = ChatTemplate(model.tokenizer).prompt(args.prompt) if args.chat else args.prompt
    try:
        result = sample(model, prompt, max_new_tokens=args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, seed=args.seed, stop=[] if args.ignore_eos else None)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    shape = "x".join(str(model.mesh.shape[a]) for a in ("data", "pipe", "tensor"))
    ended = "ended at the end of text" if result.finish_reason == "stop" else f"--max-tokens {args.max_tokens}"
    print(f"meshtron: step {model.step} of {args.checkpoint}, mesh {shape}, {len(result.new_tokens)} new tokens "
          f"({ended})", file=sys.stderr)
    print(result.continuation if args.chat else result.text)


def _eval(args: argparse.Namespace) -> None:
    """``meshtron eval``: lm-eval's tasks on a checkpoint, its results JSON printed (or written)."""
    _generation_checkpoint(args)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {args.batch_size}")
    if args.max_gen_tokens < 1:
        raise ConfigError(f"--max-gen-tokens: must be >= 1, got {args.max_gen_tokens}")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit: must be above 0 (examples, or a fraction below 1), got {args.limit}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks: name at least one lm-eval task, e.g. --tasks hellaswag,arc_easy")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include-path: {args.include_path}: no such directory; give the directory of your "
                          "task YAMLs")
    if args.output and Path(args.output).exists() and not args.overwrite:
        raise ConfigError(f"--output: {args.output} exists; give a new file (or --overwrite to replace it)")
    try:
        import lm_eval  # noqa: F401 -- the extra's presence, before any device starts
    except ImportError:
        raise ConfigError("meshtron eval needs lm-evaluation-harness: pip install meshtron[eval]") from None
    mesh = _generation_mesh(args)
    needed = devices_requested(mesh)
    if needed <= MAX_SIMULATED_DEVICES:
        ensure_cpu_devices(needed)
    from meshtron.evaluation import MeshtronLM, evaluate, parse_gen_kwargs, parse_seeds, write_results
    from meshtron.pretrained import load_pretrained

    seeds = parse_seeds(args.seed)
    gen_kwargs = None if args.gen_kwargs is None else parse_gen_kwargs(args.gen_kwargs)
    model = MeshtronLM(load_pretrained(args.checkpoint, mesh, argument=args.checkpoint_name),
                       batch_size=args.batch_size, max_gen_toks=args.max_gen_tokens, seed=seeds[2])
    limit = None if args.limit is None else (args.limit if args.limit < 1 else int(args.limit))
    results = evaluate(model, tasks, include_path=args.include_path, limit=limit, num_fewshot=args.num_fewshot,
                       seeds=seeds, gen_kwargs=gen_kwargs)
    shape = "x".join(str(model.model.mesh.shape[a]) for a in ("data", "pipe", "tensor"))
    for task, metrics in results["results"].items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                          if isinstance(v, float) and "stderr" not in k)
        print(f"{task}: {shown}")
    if args.output:
        print(f"meshtron: step {model.model.step} of {args.checkpoint}, mesh {shape}; results "
              f"{write_results(results, args.output)}", file=sys.stderr)


def _resolved(cfg: Config, program: bool = True) -> Run | None:
    """The run ``cfg`` describes, resolved before JAX starts (its stage layout and schedule checked and
    built once) when its mesh says its size; with a -1 axis, the trainer resolves it on the devices (its
    checks for the sizes given are made now)."""
    sizes = mesh_shape(cfg.mesh)
    if -1 in sizes:
        check_features(cfg)
        return None
    return resolve_run(cfg, math.prod(sizes), program=program)


def _load(args: argparse.Namespace) -> tuple[Config, ProcessGroup | None, Run | None]:
    cfg = load_config(args.config, args.overrides)
    run = _resolved(cfg)
    if getattr(args, "target", None):  # compile-only GPUs: the process itself stays on the CPU
        prepare_environment()
        return cfg, None, run
    group = resolve_group(cfg.distributed) if args.command == "train" else None
    needed = devices_requested(cfg.mesh)
    if group is not None:  # this process simulates its share of the mesh (on CPU)
        needed = cfg.distributed.local_devices or max(1, needed // group.num_processes)
    if needed <= MAX_SIMULATED_DEVICES:
        ensure_cpu_devices(needed)
    return cfg, group, run


def _train(cfg: Config, group: ProcessGroup | None, metrics: str | None, run: Run | None) -> None:
    from meshtron.train.loop import train_from_config

    if group is None:
        train_from_config(cfg, metrics, run)
        return
    from meshtron import distributed

    distributed.initialize(cfg.distributed, group)
    try:
        train_from_config(cfg, metrics, run)
    except RunStopped:  # every process stopped at the same step and saved it together: a clean end
        distributed.finish()
        raise
    except BaseException as err:  # noqa: BLE001 -- every way out of a distributed run must tell the peers
        import traceback

        status = (2 if isinstance(err, (ConfigError, CheckpointError))
                  else 130 if isinstance(err, KeyboardInterrupt) else 3)
        message = distributed.explain(err)
        if message is None and status == 3 and not isinstance(err, REPORTED_ERRORS):
            traceback.print_exc()
        print(message or f"meshtron: error: {err}", file=sys.stderr)
        distributed.fail(f"{type(err).__name__}: {err}", status)
    distributed.finish()


# Errors whose message says all a user needs (no traceback). FloatingPointError: a poisoned state
# the checkpoint refused to save (names the step).
REPORTED_ERRORS = (NonFiniteLossError, CheckpointError, FloatingPointError)


# Where each command writes: (argument, its name in messages, a directory?) -- checked before it runs.
_OUTPUTS = {
    "train": [("metrics", "--metrics", False), ("tensorboard", "--tensorboard", True)],
    "launch": [("metrics", "--metrics", False), ("tensorboard", "--tensorboard", True)],
    "tokenizer": [("output", "--output", False)],
    "preprocess": [("output", "--output", False)],
    "plot": [("output", "--output", False)],
    "import-hf": [("output", "--output", True)],
    "export-hf": [("output", "--output", True)],
    "eval": [("output", "--output", False)],
    "schedule": [("png", "--png", False), ("csv", "--csv", False)],
}


def _check_outputs(args: argparse.Namespace) -> None:
    for attribute, flag, directory in _OUTPUTS.get(args.command, []):
        check_output_path(flag, getattr(args, attribute, None), directory=directory)
    if args.command == "preprocess":  # PREFIX names two files
        for suffix in (".bin", ".idx"):
            check_output_path("--output", args.output + suffix, directory=False)


def _traceback_if_asked() -> None:
    """``MESHTRON_TRACEBACK=1``: the whole traceback above the one line (where a model factory failed)."""
    if os.environ.get("MESHTRON_TRACEBACK", "") not in ("", "0"):
        import traceback

        traceback.print_exc()


_OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)+=")


def _is_override(item: str) -> bool:
    """Whether a command-line word is a ``section.key=value`` override."""
    return bool(_OVERRIDE.match(item))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``section.key=value`` overrides accepted anywhere, before or after flags
    (argparse alone takes them only before the first flag that follows a positional)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if not (_is_override(item) and hasattr(args, "overrides"))]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}"
                     + ("" if hasattr(args, "overrides") else f" ({args.command} takes no section.key=value settings)"))
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        _check_outputs(args)
        if args.command == "configs":
            print("\n".join(_listing()))
            return 0
        if args.command == "train" and args.print_config:
            cfg = load_config(args.config, args.overrides)
            _resolved(cfg, program=False)  # a layout or schedule that cannot work: one line, not a file
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0
        if args.command == "generate":
            _generate(args)
            return 0
        if args.command == "eval":
            _eval(args)
            return 0
        if args.command == "schedule":
            _schedule(args)
            return 0
        if args.command == "launch":
            from meshtron.launch import launch

            train_args = ([f"--config={args.config}"] if args.config else []) + (
                [f"--metrics={args.metrics}"] if args.metrics else []) + (
                [f"--tensorboard={args.tensorboard}"] if args.tensorboard else []) + list(args.overrides)
            return launch(args.processes, train_args, args.config, args.overrides)
        if args.command in _TOOLS:
            _TOOLS[args.command](args)
            return 0
        if args.command == "train" and args.tensorboard:
            args.overrides = [*args.overrides, f"train.tensorboard={args.tensorboard}"]
        cfg, group, run = _load(args)
        if args.command == "train":
            _train(cfg, group, args.metrics, run)
        else:
            from meshtron.describe import describe

            describe(cfg, run=run, force_compile=args.compile, target=args.target)
    except ConfigError as err:
        _traceback_if_asked()
        print(f"meshtron: error: {err}", file=sys.stderr)
        return 2
    except REPORTED_ERRORS as err:  # NaN loss, unusable checkpoint: the messages name the step or tensor
        _traceback_if_asked()
        print(f"meshtron: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, CheckpointError) else 3  # bad input, or a run that went wrong
    except RunStopped:  # SIGTERM/SIGINT/train.max_minutes: checkpoint written, the trainer said so in one line
        return EXIT_STOPPED
    except KeyboardInterrupt:
        print("meshtron: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
