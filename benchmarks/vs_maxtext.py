"""meshtron against MaxText 0.2.5, Llama against Llama, on the same simulated CPU meshes.

The same model in both (MaxText's default ``llama2`` decoder block): 4 layers, hidden 256, 4 heads with
4 key/value heads (head 64), SwiGLU 1024, RMSNorm, rotary positions, untied head, vocabulary 1024,
sequence 128, fp32, AdamW, full recomputation (MaxText's default ``remat_policy``; ``--remat``
changes meshtron's), global batch 8 × 128 tokens. On the pipelined meshes meshtron runs
``parallel.recompute=false`` (``--pipeline-recompute`` changes it): under ``model.remat=full`` each
layer keeps its input and is recomputed once in its backward, two forwards per layer as in MaxText,
where ``true`` would also rerun the whole stage from its stashed input (three). ``--model gpt`` runs
meshtron's GPT against MaxText's ``gpt3`` decoder instead (pre-LayerNorm with biases, fused QKV, GELU
1024, learned positions, tied head; MaxText's ``gpt3-52k`` resized to the same dimensions). Each library
trains ``--steps`` steps in its own process; the two alternate, mesh by mesh, ``--rounds`` times, and the median step time after step 3 of
each run is kept. Meshes:

* one device;
* data 4 × tensor 2;
* data 2 × pipe 2 × tensor 2, GPipe with 4 microbatches (MaxText's pipeline with one repeat);
* data 2 × pipe 2 × tensor 2, circular / interleaved with 2 chunks per stage and 4 microbatches.

MaxText lives in its own virtual environment (Python 3.12, jax 0.12.0.1; the pins of
``maxtext_0.2.5_cpu_requirements.txt``, MaxText's own without the TPU-only ``libtpu``). ``--setup``
builds it in ``--maxtext-dir`` (default ``/tmp/maxtext_try``): about 140 s and 2.4 GB, with network
access to the package index.

    .venv/bin/python benchmarks/vs_maxtext.py --setup        # once
    .venv/bin/python benchmarks/vs_maxtext.py                # about 15 minutes on 2 cores; keep the machine idle

It prints step times, tokens/s and model FLOP/s (6N + 12·l·h·s per token) with MaxText's over
meshtron's step time, and each program's compile time and compiled temporaries (meshtron's from
``meshtron describe --compile`` of the same run, MaxText's from its own compiled train step); writes
``results/vs_maxtext.json`` and ``.png`` (``vs_maxtext_remat_none.*`` with ``--remat none``).

``--target h100`` trains nothing: it compiles both libraries' train steps for H100s this machine does
not have (JAX's CUDA plugin; MaxText's through ``maxtext_gpu_compile.py`` in its venv, with the plugin
and cuDNN added) -- Llama-2 7B on 8 GPUs and 70B on 64, seq 4096, MaxText FSDP as NVIDIA published it,
meshtron in an FSDP-like layout and its own -- and prices each program with
``meshtron.gpu.step_time`` (GEMM efficiency fitted on MaxText's published 7B step, ``--fit-on``),
writing ``results/vs_maxtext_h100.json``: memory, collective bytes per mesh axis, estimated step times
and the published figures (with their sources) beside the estimates. Compiles are kept in
``--hlo-dir`` (``/tmp/mt51``) and reused; ``--cached-only`` reports what is compiled there.

    .venv/bin/python benchmarks/vs_maxtext.py --setup --target h100    # once: MaxText, its CUDA plugin and cuDNN
    .venv/bin/python benchmarks/vs_maxtext.py --target h100 --meshtron-python .venv-py312/bin/python
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _common

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = Path(__file__).with_name("maxtext_0.2.5_cpu_requirements.txt")
TOKENS = 8 * 128

# The model, in each library's words.
MAXTEXT_MODEL = ["dataset_type=synthetic", "max_target_length=128", "base_emb_dim=256", "base_num_query_heads=4",
                 "base_num_kv_heads=4", "base_mlp_dim=1024", "base_num_decoder_layers=4", "head_dim=64",
                 "vocab_size=1024", "dtype=float32", "enable_checkpointing=false", "hardware=cpu",
                 "skip_jax_distributed_system=true", "jax_cache_dir="]
MESHTRON_MODEL = ["model.family=llama", "model.layers=4", "model.hidden=256", "model.heads=4", "model.kv_heads=4",
                  "model.mlp_dim=1024", "model.seq_len=128", "model.vocab_size=1024", "model.dtype=float32",
                  "model.param_dtype=float32", "train.batch_size=8", "train.eval_every=100000", "train.log_every=1"]

# meshtron's GPT (pre-LayerNorm with biases, fused QKV, GELU, learned positions, tied head) against MaxText's
# gpt3 decoder (the same block; its gpt3-52k config resized), both with AdamW.
MAXTEXT_GPT = ["dataset_type=synthetic", "max_target_length=128", "model_name=gpt3-52k", "override_model_config=true",
               "base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=1024",
               "base_num_decoder_layers=4", "head_dim=64", "trainable_position_size=128", "vocab_size=1024",
               "opt_type=adamw", "dtype=float32", "enable_checkpointing=false", "hardware=cpu",
               "skip_jax_distributed_system=true", "jax_cache_dir="]
MESHTRON_GPT = ["model.family=gpt", "model.layers=4", "model.hidden=256", "model.heads=4", "model.mlp_dim=1024",
                "model.seq_len=128", "model.vocab_size=1024", "model.dtype=float32", "model.param_dtype=float32",
                "train.batch_size=8", "train.eval_every=100000", "train.log_every=1"]

# --model: (MaxText's model arguments, meshtron's config and overrides, title)
MODELS = {
    "llama": (MAXTEXT_MODEL, "llama_cpu8", MESHTRON_MODEL, "Llama 4x256"),
    "gpt": (MAXTEXT_GPT, "cpu8", MESHTRON_GPT, "GPT 4x256"),
}

# name: (devices, MaxText arguments, meshtron overrides)
MESHES = {
    "1 device": (1, ["per_device_batch_size=8"],
                 ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=1"]),
    "data 4 x tensor 2": (8, ["per_device_batch_size=1", "ici_fsdp_parallelism=1", "ici_pipeline_parallelism=1",
                              "ici_data_parallelism=4", "ici_tensor_parallelism=2"],
                          ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "parallel.microbatches=1"]),
    "2x2x2 GPipe m=4": (8, ["per_device_batch_size=1", "ici_data_parallelism=2", "ici_tensor_parallelism=2",
                             "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=1", "num_pipeline_microbatches=4",
                             "num_layers_per_pipeline_stage=2"],
                         ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.microbatches=4",
                          "parallel.schedule=gpipe", "parallel.chunks=1"]),
    "2x2x2 circular/interleaved v=2 m=4": (
        8, ["per_device_batch_size=1", "ici_data_parallelism=2", "ici_tensor_parallelism=2",
            "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=1", "num_pipeline_microbatches=4"],
        ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.microbatches=4", "parallel.schedule=interleaved",
         "parallel.chunks=2"]),
}

# MaxText's train entry point, also printing its compiled step's memory and compile time.
MAXTEXT_WRAPPER = '''
import time
from absl import app
import jax.stages
from maxtext.utils import max_utils
from maxtext.trainers.pre_train import train

_print_memory = max_utils.print_compiled_memory_stats
def print_memory(stats, prefix=""):
    if stats is not None:
        print(f"COMPILED_TEMP_BYTES {stats.temp_size_in_bytes}", flush=True)
    return _print_memory(stats, prefix)
max_utils.print_compiled_memory_stats = print_memory

_compile = jax.stages.Lowered.compile
def timed_compile(self, *args, **kwargs):
    start = time.perf_counter()
    compiled = _compile(self, *args, **kwargs)
    print(f"COMPILE_SECONDS {time.perf_counter() - start:.2f}", flush=True)
    return compiled
jax.stages.Lowered.compile = timed_compile

if __name__ == "__main__":
    app.run(train.main)
'''


def python312() -> str:
    """Python 3.12 for MaxText: pyenv's, or python3.12 on PATH."""
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True, check=False).stdout.strip()
        candidate = Path(root) / "versions" / "3.12.1" / "bin" / "python3"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("python3.12")
    if not found:
        sys.exit("--setup: MaxText 0.2.5 needs Python 3.12 (pyenv's 3.12.1 or python3.12 on PATH); none found")
    return found


# What --target adds to MaxText's venv: JAX's CUDA plugin for its jax 0.12.0.1 (compile-only GPU devices)
# and the CUDA libraries JAX's cuDNN attention asks for while tracing (the versions meshtron's gpu-compile
# stack pins); no GPU needed.
MAXTEXT_GPU_COMPILE = ["jax-cuda12-plugin==0.12.0.1", "jax-cuda12-pjrt==0.12.0.1", "nvidia-cudnn-cu12==9.28.0.42",
                       "nvidia-cublas-cu12==12.9.3.13", "nvidia-cuda-nvrtc-cu12==12.9.86"]


def setup(directory: Path, gpu_compile: bool = False) -> None:
    venv = directory / "venv"
    directory.mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "python").exists():
        subprocess.run([python312(), "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-U", "pip"], check=True)
    subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True)
    subprocess.run([*pip, "--no-deps", "maxtext==0.2.5"], check=True)
    if gpu_compile:
        subprocess.run([*pip, "--no-deps", *MAXTEXT_GPU_COMPILE], check=True)
    (directory / "maxtext_train.py").write_text(MAXTEXT_WRAPPER)
    print(f"MaxText 0.2.5 ready in {directory}")


def median_after_3(times: dict[int, float]) -> float:
    return statistics.median(t for step, t in times.items() if step > 3)


def run_maxtext(directory: Path, name: str, devices: int, extra: list[str], steps: int,
                model: list[str] = MAXTEXT_MODEL) -> dict:
    python = directory / "venv" / "bin" / "python"
    if not python.exists():
        sys.exit(f"MaxText is not set up in {directory}: run benchmarks/vs_maxtext.py --setup first")
    config = next((directory / "venv" / "lib").glob("python3.12/site-packages/maxtext/configs/base.yml"))
    (directory / "maxtext_train.py").write_text(MAXTEXT_WRAPPER)
    out = Path(tempfile.mkdtemp(prefix="maxtext-"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "NO_GCE_CHECK": "True",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    try:
        proc = subprocess.run([str(python), str(directory / "maxtext_train.py"), str(config), f"run_name={name}",
                               f"base_output_directory={out}", f"steps={steps}", *model, *extra],
                              env=env, capture_output=True, text=True, timeout=1200, check=False)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    text = proc.stdout + proc.stderr
    times = {int(k): float(s) for k, s in re.findall(r"completed step: (\d+), seconds: ([\d.]+)", text)}
    if proc.returncode or len(times) < steps - 1:
        raise RuntimeError(f"MaxText {name} failed (exit {proc.returncode}):\n{text[-3000:]}")
    losses = re.findall(r"completed step: \d+,.*?loss: ([\d.]+)", text)
    temp = re.findall(r"COMPILED_TEMP_BYTES (\d+)", text)
    compile_s = re.findall(r"COMPILE_SECONDS ([\d.]+)", text)
    return {"step_seconds": median_after_3(times), "times": times, "last_loss": float(losses[-1]),
            "temp_bytes": int(temp[0]) if temp else None, "compile_seconds": float(compile_s[0]) if compile_s else None}


def run_meshtron(devices: int, overrides: list[str], steps: int, config: str = "llama_cpu8",
                 model: list[str] = MESHTRON_MODEL) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        proc = subprocess.run([sys.executable, "-m", "meshtron.cli", "train", "--config", config,
                               "--metrics", str(metrics), *model, *overrides, f"train.steps={steps}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False)
        if proc.returncode:
            raise RuntimeError(f"meshtron failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = {r["step"]: r["step_seconds"] for r in records if "step_seconds" in r}
    return {"step_seconds": median_after_3(times), "times": times,
            "last_loss": [r["loss"] for r in records if "loss" in r][-1],
            **compiled_figures(devices, overrides, config, model)}


def compiled_figures(devices: int, overrides: list[str], config: str = "llama_cpu8",
                     model: list[str] = MESHTRON_MODEL) -> dict:
    """meshtron's compile time and compiled temporaries for the same run (``describe --compile``)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run([sys.executable, "-m", "meshtron.cli", "describe", "--config", config, "--compile",
                           *model, *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    seconds = re.search(r"compiled in ([\d.]+) s", proc.stdout)
    temp = re.search(r"^memory: .*temporaries ([\d.]+) (\w+)", proc.stdout, re.MULTILINE)
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    return {"compile_seconds": float(seconds[1]) if seconds else None,
            "temp_bytes": int(float(temp[1]) * units[temp[2]]) if temp else None}


def model_flops_per_token(model: str = "llama") -> float:
    """6N + 12·l·h·s (:func:`meshtron.megatron.model_flops_per_token`) for this model."""
    from meshtron.megatron import model_flops_per_token as flops

    h, f, v, layers, s = 256, 1024, 1024, 4, 128
    if model == "gpt":  # biases, two LayerNorms per block, learned positions, tied head
        params = layers * (4 * h * h + 2 * h * f + 4 * h + f + h + 4 * h) + v * h + s * h + 2 * h
    else:  # SwiGLU, two RMSNorms per block, untied head
        params = layers * (4 * h * h + 3 * h * f + 2 * h) + 2 * v * h + h
    return flops(params, layers, h, s)


# ---- --target h100: both libraries' GPU programs, compiled for H100s this machine does not have -------------
#
# Each side compiles in its own environment: meshtron under Python 3.12 with JAX's CUDA plugin
# (``--meshtron-python``, the ``gpu-compile`` extra), MaxText under its own venv with the plugin added
# (``maxtext_gpu_compile.py``). Both write their scheduled GPU HLO to ``--hlo-dir``; one meshtron
# process then reads every program's collectives per mesh axis and prices it with
# ``meshtron.gpu.step_time`` (fitted on MaxText's published 7B figure, predicting the rest).

HLO_DIR = Path("/tmp/mt51")
H100_MAXTEXT_COMMON = ["hardware=gpu", "dataset_type=synthetic", "enable_checkpointing=false", "async_checkpointing=false",
                       "use_iota_embed=true", "logits_dot_in_fp32=false", "scan_layers=true", "max_target_length=4096",
                       "skip_jax_distributed_system=true", "jax_cache_dir=", "steps=10",
                       "base_output_directory=/tmp/mt51/maxtext_output", "run_name=gpu_compile"]


def llama_params(layers: int, hidden: int, kv_heads: int, heads: int, mlp: int, vocab: int) -> int:
    """Llama's parameters: q and o (h x h), k and v (h x kv·head), SwiGLU's three h x f, two RMSNorms per
    layer, untied embedding and head, the final norm."""
    kv = hidden // heads * kv_heads
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden) + 2 * vocab * hidden + hidden


# XLA flags of the fastest pipelined 70B rows: cuBLAS GEMMs; the latency-hiding scheduler's memory budget at
# (80% of the GPU's memory less the program's arguments) x 130% instead of x 95%, which the program's schedule
# exceeds by a little, so that the scheduler stops delaying collectives to save memory (the compiled
# temporaries grow by 0.1 GiB); and two collectives in flight.
PIPELINED_70B_FLAGS = ("--xla_gpu_enable_triton_gemm=false --xla_gpu_memory_limit_slop_factor=130 "
                       "--xla_gpu_experimental_parallel_collective_overlap_limit=2")
# MaxText's own program compiled again under XLA flags (label: XLA_FLAGS), priced like the others, so that the
# flags meshtron's rows use are measured on MaxText's program too. The memory budget changes nothing there;
# the pipelined all-gather makes it slower (9.32 s), so the best set found is these two.
H100_MAXTEXT_FLAGGED = {
    "llama2_70b_h100x64": {
        "cuBLAS GEMMs, two collectives in flight": ("--xla_gpu_enable_triton_gemm=false "
                                                    "--xla_gpu_experimental_parallel_collective_overlap_limit=2")},
}
# name: (devices, global batch, Llama shape (layers, hidden, kv_heads, heads, mlp, vocab), MaxText arguments,
#        meshtron layouts {label: overrides of the bundled config}, the published MaxText figure)
H100_MODELS = {
    "llama2_7b_h100x8": (
        8, 16, (32, 4096, 32, 32, 11008, 32000),
        ["model_name=llama2-7b", "per_device_batch_size=2", "remat_policy=minimal", "ici_fsdp_parallelism=8"],
        {"fsdp (data 8, zero=3)": ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.zero=3",
                                   "parallel.microbatches=1"],
         "fsdp (data 8, zero=3), remat full": ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1",
                                               "parallel.zero=3", "parallel.microbatches=1", "model.remat=full"],
         "fsdp (data 8, zero=3), bf16 reduce": ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1",
                                                "parallel.zero=3", "parallel.microbatches=1",
                                                "parallel.reduce_dtype=bfloat16"],
         "data 2 x tensor 4, zero=1, sp": ["parallel.data=2", "parallel.pipe=1", "parallel.tensor=4", "parallel.zero=1",
                                            "parallel.sequence_parallel=true", "parallel.microbatches=1"],
         "data 2 x pipe 2 x tensor 2, zb-h1, zero=1, sp": [
             "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.zero=1", "parallel.schedule=zb-h1",
             "parallel.sequence_parallel=true", "parallel.microbatches=8"]},
        {"tokens_per_s_per_gpu": 22.19 * 4096 / 8, "step_seconds": 0.721,
         "config": "BF16, seq 4096, 8 GPUs, batch 2 per GPU (GBS 16), FSDP 8, flash attention (TE), "
                   "remat_policy=minimal_flash, scan off (compiled here: scan on, cuDNN flash through JAX)",
         "source": "https://github.com/NVIDIA/JAX-Toolbox/blob/main/docs/frameworks/maxtext/README.md (Configs, LLaMA; "
                   "commit bcbbfa5)",
         "quote": "| 7B | H100 80G SXM | BF16 | 4096 | 8 | 2 | 1 | 8 | 1 | 16 | Flash | minimal_flash| Off | 0.721 | 22.19 |"
                  " (Sequences/Sec 22.19 x 4096 / 8 GPUs = 11,361 tokens/s/GPU)"}),
    "llama2_70b_h100x64": (
        64, 128, (80, 8192, 8, 64, 28672, 32000),
        ["model_name=llama2-70b", "per_device_batch_size=2", "remat_policy=full", "ici_fsdp_parallelism=64"],
        {"fsdp (data 64, zero=3)": ["parallel.data=64", "parallel.pipe=1", "parallel.tensor=1", "parallel.zero=3",
                                    "parallel.microbatches=1", "parallel.sequence_parallel=false",
                                    "parallel.gather_once=false"],
         "fsdp (data 64, zero=3), remat full": ["parallel.data=64", "parallel.pipe=1", "parallel.tensor=1",
                                                "parallel.zero=3", "parallel.microbatches=1",
                                                "parallel.sequence_parallel=false", "parallel.gather_once=false",
                                                "model.remat=full"],
         "fsdp (data 64, zero=3), remat full, bf16 reduce": [
             "parallel.data=64", "parallel.pipe=1", "parallel.tensor=1", "parallel.zero=3", "parallel.microbatches=1",
             "parallel.sequence_parallel=false", "parallel.gather_once=false", "model.remat=full",
             "parallel.reduce_dtype=bfloat16"],
         "data 2 x pipe 4 x tensor 8, 1f1b, zero=1, sp": ["parallel.data=2", "parallel.pipe=4", "parallel.tensor=8",
                                                          "parallel.zero=1", "parallel.microbatches=32",
                                                          "parallel.gather_once=false"],
         "data 2 x pipe 4 x tensor 8, 1f1b-p, zero=1, sp": ["parallel.data=2", "parallel.pipe=4", "parallel.tensor=8",
                                                            "parallel.zero=1", "parallel.microbatches=32",
                                                            "parallel.gather_once=false", "parallel.schedule=1f1b-p"],
         "data 2 x pipe 4 x tensor 8, 1f1b, zero=1, sp, kept residuals": [
             "parallel.data=2", "parallel.pipe=4", "parallel.tensor=8", "parallel.zero=1", "parallel.microbatches=32",
             "parallel.gather_once=false", "parallel.recompute=false"],
         "data 2 x pipe 4 x tensor 8, 1f1b, zero=1, sp, kept residuals, m=64, fused dW accumulation": [
             "parallel.data=2", "parallel.pipe=4", "parallel.tensor=8", "parallel.zero=1", "parallel.microbatches=64",
             "parallel.gather_once=false", "parallel.recompute=false", "parallel.gradient_accumulation_fusion=true"],
         "data 2 x pipe 8 x tensor 4, 1f1b, zero=1, sp, kept residuals, m=64, fused dW accumulation, weights cast once": [
             "parallel.data=2", "parallel.pipe=8", "parallel.tensor=4", "parallel.zero=1", "parallel.microbatches=64",
             "parallel.gather_once=false", "parallel.recompute=false", "parallel.gradient_accumulation_fusion=true",
             "parallel.cast_once=true"],
         "data 2 x pipe 8 x tensor 4, 1f1b, zero=0, sp, kept residuals, m=64, fused dW accumulation, weights cast once, "
         "cuBLAS GEMMs": [
             "parallel.data=2", "parallel.pipe=8", "parallel.tensor=4", "parallel.zero=0", "parallel.microbatches=64",
             "parallel.gather_once=false", "parallel.recompute=false", "parallel.gradient_accumulation_fusion=true",
             "parallel.cast_once=true", "gpu.xla_flags=--xla_gpu_enable_triton_gemm=false"],
         "the same, the scheduler's memory budget raised, two collectives in flight": [
             "parallel.data=2", "parallel.pipe=8", "parallel.tensor=4", "parallel.zero=0", "parallel.microbatches=64",
             "parallel.gather_once=false", "parallel.recompute=false", "parallel.gradient_accumulation_fusion=true",
             "parallel.cast_once=true", f"gpu.xla_flags={PIPELINED_70B_FLAGS}"],
         "the same, gpu.overlap=on, pipelined all-gather": [
             "parallel.data=2", "parallel.pipe=8", "parallel.tensor=4", "parallel.zero=0", "parallel.microbatches=64",
             "parallel.gather_once=false", "parallel.recompute=false", "parallel.gradient_accumulation_fusion=true",
             "parallel.cast_once=true", "gpu.overlap=on",
             f"gpu.xla_flags={PIPELINED_70B_FLAGS} --xla_gpu_pipeline_all_gather=on"]},
        {"tokens_per_s_per_gpu": 1035.970, "step_seconds": 7.908,
         "config": "BF16, seq 4096, 64 GPUs, FSDP 64 (FSDP+DP MBS=2), GBS 128, MFU 46.54% at 989 TFLOP/s; remat "
                   "and attention not in the quoted text (compiled here: remat_policy=full as MaxText's "
                   "configs/gpu/models/llama2_70b.yml, cuDNN flash through JAX, scan on)",
         "source": "https://catalog.ngc.nvidia.com/orgs/nvidia/teams/dgxc-benchmarking/resources/"
                   "maxtext-llama2-70b-dgxc-benchmarking-c (Maxtext Llama2 70B 25.01.1, DGXC Benchmarking)",
         "quote": "completed step: 49, seconds: 7.908, TFLOP/s/device: 460.480, Tokens/s/device: 1035.970, "
                  "total_weights: 524288 ... MFU = 128 * 1.82E+15 / 7.908 / 64 / 989E+12 = 46.54%",
         "issue_figure": {"tokens_per_s_per_gpu": 1170,
                          "note": "issue 51's figure; no public source found for it (the NGC recipe above shows 1,036)"}}),
}
MESHTRON_H100_COMMON = ["train.batch_size={batch}", "model.attention=cudnn", "model.remat=selective",
                        "parallel.schedule=1f1b"]


def _layout_key(model: str, label: str, overrides: list[str]) -> str:
    """A cached compile's name: the model, the layout's label and a digest of every override (a
    changed setting compiles anew)."""
    digest = hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:10]
    return model + "__" + re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_") + "__" + digest


def compile_meshtron_h100(spec: dict) -> dict:
    """(Run under the gpu-compile stack.) meshtron's train step for ``spec``'s config on H100s: compile
    seconds, memory, mesh sizes; the HLO text goes to ``spec["hlo"]``."""
    import time

    from meshtron.config import load_config
    from meshtron.gpu.targets import prepare_environment

    prepare_environment()
    from meshtron.train.loop import Trainer

    cfg = load_config(spec["config"], spec["overrides"])
    trainer = Trainer.from_config(cfg, target=spec["target"], read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    start = time.perf_counter()
    compiled = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0])
    seconds = time.perf_counter() - start
    Path(spec["hlo"]).write_text(compiled.as_text())
    memory = compiled.memory_analysis()
    return {"compile_seconds": round(seconds, 1), "hlo": spec["hlo"],
            "mesh_sizes": {str(a): int(n) for a, n in zip(trainer.mesh.axis_names, trainer.mesh.devices.shape)},
            "memory": {f: int(getattr(memory, f"{f}_size_in_bytes")) for f in ("argument", "output", "temp", "alias")}}


def meshtron_ticks(record: dict):
    """The tick table of a pipelined meshtron record (its config and overrides resolved on its devices;
    nothing compiled), so its estimate prices each tick at the slots its stages run; None for MaxText's
    programs, an unpipelined layout, or a meshtron source without per-tick pricing."""
    if record["library"] != "meshtron":
        return None
    try:
        from meshtron.gpu.pipeline_ticks import tick_table
    except ImportError:
        return None
    from meshtron.config import load_config
    from meshtron.run import resolve_run

    run = resolve_run(load_config(record["model"].split("_h100")[0], record["overrides"]), record["devices"])
    return None if run.program is None else tick_table(run.program)


def analyze_h100(records: list[dict], target: str) -> list[dict]:
    """(Run under the gpu-compile stack.) Collective bytes per mesh axis of each compiled program, and
    its estimated step time when ``meshtron.gpu.step_time`` is there: GEMM efficiency fitted on the
    first record with a published step time (MaxText's 7B), then used for every program; a pipelined
    meshtron program priced tick by tick (:func:`meshtron_ticks`)."""
    from meshtron.hlo.collectives import bytes_by_axes, collectives

    try:
        from meshtron.gpu import step_time
    except ImportError:
        step_time = None
    texts = {r["hlo"]: Path(r["hlo"]).read_text() for r in records}
    fitted = None
    if step_time is not None:
        anchor = next(r for r in records if r.get("fit_seconds"))
        fitted = step_time.fit_gemm_efficiency(texts[anchor["hlo"]], anchor["mesh_sizes"], target,
                                               measured_seconds=anchor["fit_seconds"])
    out = []
    for r in records:
        colls = collectives(texts[r["hlo"]], r["mesh_sizes"])
        wire: dict[str, float] = {}
        for c in colls:
            key = "+".join(c.axes) or "none"
            wire[key] = wire.get(key, 0.0) + c.total_wire_bytes
        figures = {"collective_bytes_per_axis": {"+".join(k) or "none": v for k, v in bytes_by_axes(colls).items()},
                   "collective_wire_bytes_per_axis": wire, "estimated_step_seconds": None,
                   "estimated_tokens_per_s_per_gpu": None, "estimated_mfu": None}
        if step_time is not None:
            kwargs = {"tokens_per_step": r["tokens_per_step"], "model_flops_per_step": r["model_flops_per_step"],
                      "causal_attention_flops_per_step": r.get("attention_flops_per_step", 0.0)}
            if fitted is not None:
                kwargs["gemm_efficiency"] = getattr(fitted, "gemm_efficiency", fitted)
            ticks = meshtron_ticks(r)
            if ticks is not None:
                kwargs["ticks"] = ticks
            estimate = step_time.estimate_step(texts[r["hlo"]], r["mesh_sizes"], target, **kwargs)
            figures.update(estimated_step_seconds=estimate.seconds, estimated_per_tick=getattr(estimate, "per_tick", False),
                           estimated_tokens_per_s_per_gpu=estimate.tokens_per_s_per_gpu, estimated_mfu=estimate.mfu)
            figures.update(gemm_efficiency=estimate.gemm_efficiency, estimated_compute_seconds=estimate.compute_seconds,
                           estimated_memory_seconds=estimate.memory_seconds,
                           estimated_exposed_communication_seconds=estimate.exposed_communication_seconds,
                           estimated_communication_seconds=estimate.communication_seconds)
        out.append({**r, **figures})
    return out


def _child(python: Path, mode: str, payload, env: dict, timeout: int = 3600) -> object:
    """Run this script as ``mode`` under ``python`` (the gpu-compile stack), payload in and out as JSON."""
    proc = subprocess.run(["nice", "-n", "10", str(python), str(Path(__file__).resolve()), "--child", mode,
                           json.dumps(payload)],
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode:
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_maxtext_h100(python: Path, description: Path, target: str, devices: int, hlo: Path,
                         arguments: list[str], xla_flags: str = "") -> dict:
    """MaxText's own train step for ``devices`` GPUs of ``target`` (``maxtext_gpu_compile.py`` in its venv),
    under ``xla_flags`` (``XLA_FLAGS``) when given."""
    env = _gpu_env()
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    proc = subprocess.run(["nice", "-n", "10", str(python), str(Path(__file__).with_name("maxtext_gpu_compile.py")),
                           "--description", str(description), "--target", target, "--devices", str(devices),
                           "--hlo", str(hlo), "--", *H100_MAXTEXT_COMMON, *arguments],
                          env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode:
        raise RuntimeError(f"MaxText's compile failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gpu_env(pythonpath: Path | None = None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "NO_GCE_CHECK": "True"}
    env.pop("XLA_FLAGS", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def _cached(path: Path, cached_only: bool, make) -> dict | None:
    """A compile's figures, kept in ``path`` so a rerun skips the programs already compiled; with
    ``cached_only`` a program not compiled yet is left out (None)."""
    if path.exists():
        return json.loads(path.read_text())
    if cached_only:
        return None
    figures = make()
    path.write_text(json.dumps(figures, indent=2))
    return figures


def _h100_common(model: str) -> dict:
    """The figures of ``model``'s step both libraries share: tokens and model FLOPs per step."""
    devices, batch, shape = H100_MODELS[model][:3]
    return {"model": model, "devices": devices, "global_batch": batch, "tokens_per_step": batch * 4096,
            "model_flops_per_step": model_flops_per_token_llama(shape, 4096) * batch * 4096,
            "attention_flops_per_step": 12.0 * shape[0] * shape[1] * 4096 * batch * 4096}


def run_h100(args) -> None:
    target = args.target
    hlo_dir: Path = args.hlo_dir
    hlo_dir.mkdir(parents=True, exist_ok=True)
    mt_python = args.maxtext_dir / "venv" / "bin" / "python"
    if not mt_python.exists():
        sys.exit(f"MaxText is not set up in {args.maxtext_dir}: run benchmarks/vs_maxtext.py --setup first")
    description = ROOT / "src" / "meshtron" / "gpu" / "descriptions" / f"{target}.txtpb"
    records = []
    flash = args.maxtext_attention != "dot_product"
    suffix = "" if flash else f"_{args.maxtext_attention}"
    for model, (devices, batch, shape, mt_args, _, published) in H100_MODELS.items():  # MaxText's programs first
        arguments = [f"attention={args.maxtext_attention}",
                     *(a.replace("remat_policy=minimal", "remat_policy=minimal_flash") if flash else a for a in mt_args)]
        hlo = hlo_dir / f"maxtext_{model}{suffix}.hlo.txt"
        print(f"MaxText {model} on {devices} {target}, attention={args.maxtext_attention}...", flush=True)
        mt = _cached(hlo_dir / f"maxtext_{model}{suffix}.json", args.cached_only,
                     functools.partial(compile_maxtext_h100, mt_python, description, target, devices, hlo, arguments))
        if mt is not None:
            records.append({**_h100_common(model), "library": "maxtext", "layout": mt["layout"], **mt,
                            "fit_seconds": published["step_seconds"] if model == args.fit_on else None,
                            "published": published})
        for label, flags in H100_MAXTEXT_FLAGGED.get(model, {}).items():
            key = f"{model}{suffix}_" + hashlib.sha256(flags.encode()).hexdigest()[:10]
            print(f"MaxText {model} under XLA_FLAGS={flags}...", flush=True)
            variant = _cached(hlo_dir / f"maxtext_{key}.json", args.cached_only,
                              functools.partial(compile_maxtext_h100, mt_python, description, target, devices,
                                                hlo_dir / f"maxtext_{key}.hlo.txt", arguments, flags))
            if variant is not None:
                records.append({**_h100_common(model), "library": "maxtext-flags", "layout": variant["layout"],
                                **variant, "flags_label": label, "xla_flags": flags, "fit_seconds": None})
    for model, (_, batch, _, _, layouts, _) in H100_MODELS.items():
        for label, overrides in layouts.items():
            every = [*(o.format(batch=batch) for o in MESHTRON_H100_COMMON), *overrides]
            key = _layout_key(model, label, every)
            spec = {"config": model.split("_h100")[0], "target": target, "hlo": str(hlo_dir / f"meshtron_{key}.hlo.txt"),
                    "overrides": every}
            print(f"meshtron {model} {label}...", flush=True)
            mx = _cached(hlo_dir / f"meshtron_{key}.json", args.cached_only,
                         functools.partial(_child, args.meshtron_python, "compile-meshtron", spec, _gpu_env(args.meshtron_src)))
            if mx is not None:
                records.append({**_h100_common(model), "library": "meshtron", "layout": label,
                                "overrides": spec["overrides"], **mx})
    analyzed = _child(args.meshtron_python, "analyze", {"records": records, "target": target}, _gpu_env(args.meshtron_src))
    results = []
    for model in H100_MODELS:
        rows = [r for r in analyzed if r["model"] == model]
        mt = next((r for r in rows if r["library"] == "maxtext"), None)
        if mt is None:
            continue
        published = mt["published"]
        for mx in (r for r in rows if r["library"] == "meshtron"):
            results.append({
                "model": model, "devices": mt["devices"], "global_batch": mt["global_batch"], "seq_len": 4096,
                "maxtext_layout": mt["layout"], "meshtron_layout": mx["layout"], "meshtron_overrides": mx["overrides"],
                "maxtext_estimated_step_seconds": mt["estimated_step_seconds"],
                "meshtron_estimated_step_seconds": mx["estimated_step_seconds"],
                "meshtron_estimated_per_tick": mx.get("estimated_per_tick", False),
                "maxtext_estimated_tokens_per_s_per_gpu": mt["estimated_tokens_per_s_per_gpu"],
                "meshtron_estimated_tokens_per_s_per_gpu": mx["estimated_tokens_per_s_per_gpu"],
                "estimate_parts": {lib: {k: r.get(k) for k in ("gemm_efficiency", "estimated_compute_seconds",
                                                                "estimated_memory_seconds", "estimated_communication_seconds",
                                                                "estimated_exposed_communication_seconds", "estimated_mfu")}
                                   for lib, r in (("maxtext", mt), ("meshtron", mx))},
                "compile_seconds": {"maxtext": mt["compile_seconds"], "meshtron": mx["compile_seconds"]},
                "memory_bytes": {"maxtext": mt["memory"], "meshtron": mx["memory"]},
                "collective_bytes_per_axis": {"maxtext": mt["collective_bytes_per_axis"],
                                              "meshtron": mx["collective_bytes_per_axis"]},
                "collective_wire_bytes_per_axis": {"maxtext": mt["collective_wire_bytes_per_axis"],
                                                   "meshtron": mx["collective_wire_bytes_per_axis"]},
                "hlo": {"maxtext": mt["hlo"], "meshtron": mx["hlo"]},
                **floor_of(mt, target),
            })
    flagged = [{"model": r["model"], "label": r["flags_label"], "xla_flags": r["xla_flags"],
                "estimated_step_seconds": r["estimated_step_seconds"], "memory_bytes": r["memory"],
                **{k: r.get(k) for k in ("estimated_compute_seconds", "estimated_memory_seconds",
                                         "estimated_exposed_communication_seconds")}}
               for r in analyzed if r["library"] == "maxtext-flags"]
    published = [{"model": m, "published_tokens_per_s_per_gpu": r["published"]["tokens_per_s_per_gpu"],
                  "estimated_tokens_per_s_per_gpu": r["estimated_tokens_per_s_per_gpu"],
                  "estimated_step_seconds": r["estimated_step_seconds"], "published_step_seconds": r["published"]["step_seconds"],
                  "fitted_on": r["fit_seconds"] is not None, **{k: v for k, v in r["published"].items()
                                                               if k not in ("tokens_per_s_per_gpu", "step_seconds")}}
                 for m, r in ((r["model"], r) for r in analyzed if r["library"] == "maxtext")]
    estimator = "meshtron.gpu.step_time" if any(r["estimated_step_seconds"] is not None for r in analyzed) else None
    rows = [[r["model"], r["meshtron_layout"], _fmt(r["maxtext_estimated_step_seconds"], "{:.3f}"),
             _fmt(r["meshtron_estimated_step_seconds"], "{:.3f}"),
             " / ".join(_fmt(r["memory_bytes"][lib]["temp"], "{:.1f}", 2**-30) for lib in ("maxtext", "meshtron")),
             " / ".join(_fmt(r["compile_seconds"][lib], "{:.0f}") for lib in ("maxtext", "meshtron"))] for r in results]
    _common.print_table(["model", "meshtron layout", "MaxText est. s", "meshtron est. s", "temp GiB (MT / mx)",
                         "compile s (MT / mx)"], rows)
    for f in flagged:
        print(f"MaxText {f['model']} under {f['label']} ({f['xla_flags']}): estimated "
              f"{_fmt(f['estimated_step_seconds'], '{:.3f}')} s")
    for p in published:
        print(f"{p['model']}: published {p['published_tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, estimated "
              f"{_fmt(p['estimated_tokens_per_s_per_gpu'], '{:,.0f}')}{' (fitted on this one)' if p['fitted_on'] else ''}")
    path = _common.write_results(f"vs_maxtext_{target}", {
        "target": target, "estimator": estimator, "meshtron_src": str(args.meshtron_src),
        "estimator_note": None if estimator else "meshtron.gpu.step_time is not in this checkout: estimated fields are null",
        "maxtext_attention": args.maxtext_attention,
        "maxtext_attention_note": "MaxText's GPU default (tokamax) refuses the cpu platform and cudnn_flash_te needs "
                                  "Transformer Engine (not in MaxText's venv); cudnn_flash_jax is cuDNN flash attention "
                                  "through JAX, the nearest to the published runs' TE flash attention",
        "meshtron_common_overrides": MESHTRON_H100_COMMON, "maxtext_common_arguments": H100_MAXTEXT_COMMON,
        "fit_on": args.fit_on, "results": results, "published": published, "maxtext_under_xla_flags": flagged})
    print(f"wrote {path}")
    if estimator:
        plot_h100(results, published, target)


def floor_of(maxtext: dict, target: str) -> dict:
    """The model's FLOP floor (:func:`meshtron.gpu.step_time.flop_floor_seconds` at the fitted GEMM
    efficiency) beside MaxText's estimate: how far ahead of MaxText any layout could possibly be."""
    try:
        from meshtron.gpu.step_time import flop_floor_seconds
    except ImportError:
        return {}
    if maxtext.get("estimated_step_seconds") is None or maxtext.get("gemm_efficiency") is None:
        return {}
    floor = flop_floor_seconds(target, maxtext["devices"], model_flops_per_step=maxtext["model_flops_per_step"],
                               causal_attention_flops_per_step=maxtext["attention_flops_per_step"],
                               gemm_efficiency=maxtext["gemm_efficiency"])
    return {"flop_floor_step_seconds": floor,
            "maxtext_over_floor": maxtext["estimated_step_seconds"] / floor}


def plot_h100(results: list[dict], published: list[dict], target: str) -> None:
    """Estimated step time per pair (MaxText's layout beside each meshtron layout), and the published
    figures beside the estimator's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (pairs, figures) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    labels = [f"{r['model'].split('_h100')[0]}\n{r['meshtron_layout']}" for r in results]
    x = range(len(results))
    pairs.barh([i + 0.2 for i in x], [r["maxtext_estimated_step_seconds"] for r in results], 0.4, label="MaxText")
    pairs.barh([i - 0.2 for i in x], [r["meshtron_estimated_step_seconds"] for r in results], 0.4, label="meshtron")
    pairs.set_yticks(list(x), labels, fontsize=7)
    pairs.set_xscale("log")
    pairs.set_xlabel(f"estimated step seconds on {target} (log)")
    pairs.legend()
    names = [p["model"].split("_h100")[0] for p in published]
    y = range(len(published))
    figures.bar([i - 0.2 for i in y], [p["published_tokens_per_s_per_gpu"] for p in published], 0.4, label="published")
    figures.bar([i + 0.2 for i in y], [p["estimated_tokens_per_s_per_gpu"] for p in published], 0.4,
                label="estimated (7B fitted)")
    figures.set_xticks(list(y), names)
    figures.set_yscale("log")
    figures.set_ylabel("MaxText tokens/s per GPU (log)")
    figures.legend(fontsize=7)
    fig.suptitle(f"meshtron and MaxText: both steps compiled for {target} without the hardware, priced by one estimator")
    fig.tight_layout()
    fig.savefig(_common.RESULTS / f"vs_maxtext_{target}.png", dpi=120)


def model_flops_per_token_llama(shape: tuple[int, ...], seq_len: int) -> float:
    """6N + 12·l·h·s for a Llama of ``shape`` (layers, hidden, kv_heads, heads, mlp, vocab)."""
    layers, hidden, kv_heads, heads, mlp, vocab = shape
    return 6.0 * llama_params(layers, hidden, kv_heads, heads, mlp, vocab) + 12.0 * layers * hidden * seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="build MaxText 0.2.5's environment and exit")
    parser.add_argument("--maxtext-dir", type=Path, default=Path("/tmp/maxtext_try"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--remat", default="full", choices=("full", "selective", "none"),
                        help="meshtron's model.remat (MaxText runs its default, remat_policy=full)")
    parser.add_argument("--pipeline-recompute", default="false", choices=("false", "true"),
                        help="meshtron's parallel.recompute on the pipelined meshes")
    parser.add_argument("--model", default="llama", choices=tuple(MODELS),
                        help="llama: meshtron's Llama against MaxText's llama2; gpt: meshtron's GPT against its gpt3")
    parser.add_argument("--meshes", default=",".join(MESHES), help="comma-separated names of the meshes to run")
    parser.add_argument("--target", choices=("h100",), help="compile both libraries' steps for these GPUs (no GPU "
                        "needed) and compare their estimated step times, instead of training on the CPU")
    parser.add_argument("--meshtron-python", type=Path, default=ROOT / ".venv-py312" / "bin" / "python",
                        help="--target: a Python with meshtron's gpu-compile extra (JAX's CUDA plugin)")
    parser.add_argument("--meshtron-src", type=Path, default=ROOT / "src",
                        help="--target: the meshtron source the compiles and the estimate import")
    parser.add_argument("--hlo-dir", type=Path, default=HLO_DIR, help="--target: where the compiled HLO goes")
    parser.add_argument("--fit-on", default="llama2_7b_h100x8", choices=tuple(H100_MODELS),
                        help="--target: the published MaxText figure the estimator's GEMM efficiency is fitted on")
    parser.add_argument("--maxtext-attention", default="cudnn_flash_jax", choices=("cudnn_flash_jax", "dot_product"),
                        help="--target: MaxText's attention (cudnn_flash_jax: cuDNN flash attention through JAX, with "
                             "remat_policy=minimal_flash where the published run used minimal_flash)")
    parser.add_argument("--cached-only", action="store_true",
                        help="--target: compile nothing; report the programs already compiled in --hlo-dir")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, payload = args.child[0], json.loads(args.child[1])
        if mode == "compile-meshtron":
            print(json.dumps(compile_meshtron_h100(payload)))
        else:
            print(json.dumps(analyze_h100(payload["records"], payload["target"])))
        return
    if args.setup:  # before --target: `--setup --target h100` builds MaxText with its GPU-compile packages
        setup(args.maxtext_dir, gpu_compile=args.target is not None)
        return
    if args.target:
        run_h100(args)
        return
    names = [n.strip() for n in args.meshes.split(",")]
    unknown = [n for n in names if n not in MESHES]
    if unknown:
        sys.exit(f"--meshes: unknown {unknown}; choose from {list(MESHES)}")
    runs: dict[str, dict[str, list[dict]]] = {n: {"maxtext": [], "meshtron": []} for n in names}
    maxtext_model, config, meshtron_model, title = MODELS[args.model]
    for round_ in range(args.rounds):
        for name in names:
            devices, mt_args, mx_overrides = MESHES[name]
            mt = run_maxtext(args.maxtext_dir, f"r{round_}", devices, mt_args, args.steps, maxtext_model)
            pipelined = "parallel.pipe=1" not in mx_overrides
            mx = run_meshtron(devices, [*mx_overrides, f"model.remat={args.remat}",
                                        *([f"parallel.recompute={args.pipeline_recompute}"] if pipelined else [])],
                              args.steps, config, meshtron_model)
            runs[name]["maxtext"].append(mt)
            runs[name]["meshtron"].append(mx)
            print(f"  round {round_ + 1} {name}: MaxText {mt['step_seconds']:.3f} s, meshtron {mx['step_seconds']:.3f} s",
                  flush=True)
    flops = model_flops_per_token(args.model)
    rows, results = [], []
    for name in names:
        mt = [r["step_seconds"] for r in runs[name]["maxtext"]]
        mx = [r["step_seconds"] for r in runs[name]["meshtron"]]
        mt_s, mx_s = statistics.median(mt), statistics.median(mx)
        first = {lib: runs[name][lib][0] for lib in ("maxtext", "meshtron")}
        results.append({"mesh": name, "maxtext_step_seconds": mt, "meshtron_step_seconds": mx,
                        "ratio": mt_s / mx_s, "model_flops_per_token": flops,
                        "compile_seconds": {lib: first[lib]["compile_seconds"] for lib in first},
                        "temp_bytes": {lib: first[lib]["temp_bytes"] for lib in first},
                        "last_loss": {lib: [r["last_loss"] for r in runs[name][lib]] for lib in first}})
        rows.append([name, " / ".join(f"{t:.3f}" for t in mt), " / ".join(f"{t:.3f}" for t in mx),
                     f"{TOKENS / mt_s:,.0f}", f"{TOKENS / mx_s:,.0f}", f"{TOKENS / mt_s * flops / 1e9:.1f}",
                     f"{TOKENS / mx_s * flops / 1e9:.1f}", f"{mt_s / mx_s:.2f}",
                     " / ".join(_fmt(first[lib]["compile_seconds"], "{:.1f}") for lib in ("maxtext", "meshtron")),
                     " / ".join(_fmt(first[lib]["temp_bytes"], "{:.1f}", 2**-20) for lib in ("maxtext", "meshtron"))])
    print(f"{title}, seq 128, batch 8, fp32, meshtron remat {args.remat} (pipelined: parallel.recompute="
          f"{args.pipeline_recompute}); median step s after step 3, per round")
    _common.print_table(["mesh", "MaxText s", "meshtron s", "MaxText tok/s", "meshtron tok/s", "MaxText GFLOP/s",
                         "meshtron GFLOP/s", "MaxText/meshtron", "compile s (MT / mx)", "temp MiB (MT / mx)"], rows)
    name = "vs_maxtext" + ("_gpt" if args.model == "gpt" else "")
    if args.remat != "full":
        name += f"_remat_{args.remat}"
    if args.pipeline_recompute == "true":
        name += "_stage_recompute"
    path = _common.write_results(name, {"model": args.model, "remat": args.remat, "pipeline_recompute": args.pipeline_recompute,
                                        "steps": args.steps, "rounds": args.rounds,
                                        "results": results})
    plot(results, name, title)
    print(f"wrote {path}")


def _fmt(value: float | None, pattern: str, scale: float = 1.0) -> str:
    return "-" if value is None else pattern.format(value * scale)


def plot(results: list[dict], name: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(results))
    for offset, lib, label in ((-0.2, "maxtext", "MaxText 0.2.5"), (0.2, "meshtron", "meshtron")):
        times = [r[f"{lib}_step_seconds"] for r in results]
        ax.bar(x + offset, [TOKENS / statistics.median(t) for t in times], width=0.4, label=label)
        for xi, t in zip(x, times):
            ax.scatter([xi + offset] * len(t), [TOKENS / s for s in t], color="k", s=8, zorder=3)
    for xi, r in zip(x, results):
        ax.text(xi + 0.2, TOKENS / statistics.median(r["meshtron_step_seconds"]), f"{r['ratio']:.2f}x",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [r["mesh"] for r in results], fontsize=8)
    ax.set_ylabel("tokens/s (median; dots: rounds)")
    ax.set_title(f"{title} on simulated CPU meshes: meshtron against MaxText 0.2.5")
    ax.legend()
    fig.tight_layout()
    fig.savefig(_common.RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
