"""The training loop: data -> jitted step -> metrics, progress bar, periodic held-out evaluation."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import IO, Any

import jax
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from meshtron.analysis import format_bytes
from meshtron.config import Config, MeshConfig, validate
from meshtron.data import BatchStream, Corpus, heldout_stream
from meshtron.mesh import build_mesh, resolve_sizes
from meshtron.optim import OptimizerSetup, learning_rate_schedule, optimizer_setup
from meshtron.pipeline.schedules import compile_program, make_schedule
from meshtron.train.pipelined import to_canonical, to_stage_order
from meshtron.train.state import ModelDef, Params, dims_from_config
from meshtron.train.step import TrainSteps, build_steps


@dataclass
class TrainResult:
    """What a run produced, for the summary and for callers (tests, benchmarks)."""

    losses: list[float]
    heldout_loss: float
    unigram_loss: float
    tokens_per_s: float
    wall_time_s: float
    steps: int
    params: Any = None  # the trained parameters: canonical nested dict (layers in order), sharded on the mesh
    data_bytes: float = 0.0  # bytes one device sent over `data` in the whole run (from the compiled steps)
    stage_steps: dict[str, int] = field(default_factory=dict)  # optimizer steps run in each stage
    evaluations: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), the last at the end


@dataclass
class Trainer:
    """Everything one run needs, built from a :class:`Config` (usable without the CLI)."""

    cfg: Config
    mesh: jax.sharding.Mesh
    model_def: ModelDef
    steps: TrainSteps
    corpus: Corpus
    optimizer: OptimizerSetup

    @classmethod
    def from_config(cls, cfg: Config, devices=None, *, verbose: bool = False) -> Trainer:
        devices = list(jax.devices() if devices is None else devices)
        data, pipe, tensor = resolve_sizes(cfg.mesh, len(devices))
        cfg = replace(cfg, mesh=MeshConfig(data=data, pipe=pipe, tensor=tensor))
        validate(cfg)  # again, now that a -1 axis has its real size
        mesh = build_mesh(cfg.mesh, devices, verbose=verbose)
        corpus = Corpus.from_config(
            cfg.data, seq_len=cfg.model.seq_len, batch_size=cfg.train.batch_size, vocab_size=cfg.model.vocab_size
        )
        model_def = ModelDef.create(dims_from_config(cfg.model, tensor))
        program = None
        if pipe > 1:
            schedule = make_schedule(cfg.pipeline.schedule, pipe, cfg.train.microbatches, cfg.pipeline.chunks)
            program = compile_program(schedule)
        optimizer = optimizer_setup(cfg, param_specs=model_def.shardings(mesh))
        steps = build_steps(
            model_def, mesh, optimizer.reduction, optimizer.transform,
            microbatches=cfg.train.microbatches, program=program, stages=optimizer.stages,
        )
        return cls(cfg, mesh, model_def, steps, corpus, optimizer)

    def init_params(self) -> Params:
        """Fresh parameters, sharded; with pipelining, block layers are put in stage order."""
        params = self.model_def.init(self.mesh, self.cfg.train.seed)
        pipe = self.mesh.shape["pipe"]
        if pipe == 1:
            return params
        reorder = partial(to_stage_order, layers=self.cfg.model.layers, stages=pipe, chunks=self.cfg.pipeline.chunks)
        with jax.set_mesh(self.mesh):
            return jax.jit(reorder, out_shardings=self.steps.param_shardings, donate_argnums=0)(params)

    def canonical_params(self, params: Params) -> Params:
        """Training-layout parameters back in canonical layer order (undoes :meth:`init_params`' reorder)."""
        pipe = self.mesh.shape["pipe"]
        if pipe == 1:
            return params
        reorder = partial(to_canonical, layers=self.cfg.model.layers, stages=pipe, chunks=self.cfg.pipeline.chunks)
        with jax.set_mesh(self.mesh):
            return jax.jit(reorder, out_shardings=self.steps.param_shardings)(params)

    def train_stream(self, position: int = 0) -> BatchStream:
        t = self.cfg.train
        return BatchStream(
            self.corpus.train, batch_size=t.batch_size, seq_len=self.cfg.model.seq_len, seed=t.seed, position=position
        )

    def evaluate(self, params) -> float:
        t = self.cfg.train
        stream = heldout_stream(self.corpus, batch_size=t.batch_size, seq_len=self.cfg.model.seq_len, seed=t.seed)
        losses = [self.steps.eval(params, stream.batch(i, self.steps.batch_sharding)) for i in range(t.eval_batches)]
        return float(np.mean(jax.device_get(losses)))

    def run(self, *, metrics_file: IO[str] | None = None, console: Console | None = None) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        console = console or Console(stderr=True)
        schedule = learning_rate_schedule(t)
        params = self.init_params()
        opt_state = self.steps.init_opt_state(params)
        stream = self.train_stream()
        tokens_per_step = t.batch_size * cfg.model.seq_len
        unigram = self.corpus.unigram_loss()

        losses: list[float] = []
        heldout = float("nan")
        timed_steps, timed_seconds = 0, 0.0
        data_bytes, stage_steps = 0.0, {name: 0 for name in self.steps.stages}
        evaluations: list[tuple[int, float]] = []
        staged = len(self.steps.stages) > 1
        start = time.perf_counter()
        progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[stage]}{task.fields[comm]}/step"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        with progress:
            task = progress.add_task("train", total=t.steps, loss="-", tps="-", lr="-", stage="", comm="-")
            for step in range(1, t.steps + 1):
                stage = self.optimizer.stage_at(step - 1)
                batch = stream.next(self.steps.batch_sharding)
                tick = time.perf_counter()
                params, opt_state, metrics = self.steps.train(params, opt_state, batch, stage)
                loss, grad_norm = metrics.mean()  # blocks until the step is done
                elapsed = time.perf_counter() - tick
                if stage_steps[stage] > 0:  # a stage's first step includes its compilation
                    timed_steps += 1
                    timed_seconds += elapsed
                stage_bytes = self.steps.data_bytes(stage)
                data_bytes += stage_bytes
                stage_steps[stage] += 1
                losses.append(loss)
                tps = tokens_per_step * timed_steps / timed_seconds if timed_seconds else float("nan")
                lr = float(schedule(step - 1))
                logged = step % t.log_every == 0 or step == t.steps
                if logged or stage_steps[stage] == 1:  # also show a new stage's traffic at once
                    progress.update(
                        task, loss=f"{loss:.4f}", tps=f"{tps:,.0f}", lr=f"{lr:.2e}",
                        stage=f"{stage} " if staged else "", comm=format_bytes(stage_bytes),
                    )
                if logged and metrics_file is not None:
                    record = {
                        "step": step,
                        "loss": loss,
                        "tokens_per_s": tps,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "stage": stage,
                        "data_bytes": stage_bytes,
                    }
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                if step % t.eval_every == 0 and step != t.steps:
                    heldout = self.evaluate(params)
                    evaluations.append((step, heldout))
                    progress.console.print(f"step {step}: held-out loss {heldout:.4f} (unigram {unigram:.4f})")
                progress.advance(task)
            heldout = self.evaluate(params)
            evaluations.append((t.steps, heldout))
        wall = time.perf_counter() - start
        tps = tokens_per_step * timed_steps / timed_seconds if timed_seconds else float("nan")
        return TrainResult(
            losses, heldout, unigram, tps, wall, t.steps, self.canonical_params(params), data_bytes, stage_steps,
            evaluations,
        )


def print_summary(result: TrainResult, trainer: Trainer, out=None) -> None:
    out = out or sys.stdout
    mesh = dict(trainer.mesh.shape)
    margin = result.unigram_loss - result.heldout_loss
    lines = [
        "",
        (f"mesh {mesh}  model {trainer.cfg.model.layers}x{trainer.cfg.model.hidden}  "
        f"steps {result.steps}  data {trainer.corpus.source}"),
        f"held-out loss     {result.heldout_loss:.4f} nats/token",
        (f"unigram baseline  {result.unigram_loss:.4f} nats/token  (model is {abs(margin):.4f} "
         f"{'below' if margin > 0 else 'above'} it)"),
        f"throughput        {result.tokens_per_s:,.0f} tokens/s (after compilation)",
        (f"sent over data    {format_bytes(result.data_bytes)} per device in the run ("
         + ", ".join(f"{name}: {n} steps" for name, n in result.stage_steps.items()) + ")"),
        f"wall time         {result.wall_time_s:.1f} s",
    ]
    print("\n".join(lines), file=out)


def train_from_config(cfg: Config, metrics_path: str | None = None) -> TrainResult:
    trainer = Trainer.from_config(cfg, verbose=True)
    if metrics_path:
        Path(metrics_path).parent.mkdir(parents=True, exist_ok=True)
        with open(metrics_path, "w") as f:
            result = trainer.run(metrics_file=f)
    else:
        result = trainer.run()
    print_summary(result, trainer)
    return result
