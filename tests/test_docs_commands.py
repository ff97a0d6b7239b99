"""Every shell command in the README and the guides runs as written, in a fresh process.

The runner extracts each page's ```bash blocks (and the ``$ meshtron ...`` lines of its example
outputs) and runs them in page order with ``bash`` in a scratch directory of the page's own, with a
``HOME`` of its own and only the environment a user has: the installed ``meshtron`` on ``PATH``, no
simulated-device flags (a command sets its own device count), and the tests' XLA optimisation level
and compilation cache (:mod:`subprocess_env`). What the pages assume a user already has is put there
first: Hugging Face models at ``~/models/...`` (tiny, with the same config fields and tensor names as
the real ones), a corpus, SFT examples, a model and a cluster file, and ``data/web`` where a page
uses it without making it.

Training commands are run as written with a budget appended (:data:`BUDGET`: two steps of 8 sequences
of 64 tokens, and a held-out evaluation at the end): overrides are taken anywhere on the command line,
so the command's own flags, paths and settings are what runs, at a size this machine runs in seconds. A command that cannot run here is listed in :data:`NOT_RUN` with
the reason; every other command must exit 0, and the documented output of a ``$`` line must appear
in what it prints.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from subprocess_env import RUNNING, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# Appended to every training run: two steps of 8 sequences of 64 tokens (half the bundled CPU configs'
# window; an import's is its model's, up to 4,096), then the held-out loss. A doc's own settings come first,
# and a later override wins. At the tests' XLA optimisation level (conftest.py) a step's run time grows
# with its tokens: a mixture of 64 experts' two steps took longer than its compile at 128.
BUDGET = ["train.steps=2", "train.eval_every=2", "train.eval_batches=1", "train.log_every=1", "train.batch_size=8",
          "model.seq_len=64"]

# Commands no test can run here, and why (matched against the start of the command).
NOT_RUN = {
    "make test": "runs this test suite",
    "srun ": "needs a SLURM cluster",
    "#SBATCH": "a SLURM directive",
    "[ $? -eq 75 ]": "SLURM requeueing",
    "#!/bin/bash": "a batch script's first line",
    "pip install": "installs packages (the gpu-compile extra: make test-py312 installs it)",
    "meshtron describe --target": "compiles for GPU targets with the gpu-compile extra, which the second stack has: "
                                  "tests/test_gpu_targets.py runs describe --target there",
}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # as written, continuation lines joined
    output: tuple[str, ...] = ()  # the documented output of a ``$`` line


def _joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Continuation lines (ending in a backslash) joined; blank and comment-only lines dropped."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, raw in lines:
        text = raw.rstrip()
        if pending is not None:
            number, text = pending[0], pending[1] + " " + text.strip()
            pending = None
        if text.endswith("\\"):
            pending = (number, text[:-1].rstrip())
            continue
        if text.strip() and not (text.lstrip().startswith("#") and not text.lstrip().startswith(("#SBATCH", "#!"))):
            out.append((number, text.strip()))
    return out


def page_commands(page: Path) -> list[Command]:
    """The commands of one page, in page order."""
    text = page.read_text()
    name = page.relative_to(ROOT).as_posix()
    found: list[Command] = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        language, body = block.groups()
        first = text[: block.start(2)].count("\n") + 1
        lines = list(enumerate(body.splitlines(), first))
        if language in ("bash", "sh", "shell"):
            found += [Command(name, n, c) for n, c in _joined(lines)]
        elif not language:  # an example output: its ``$ command`` lines run, the lines after them are expected
            for k, (n, line) in enumerate(lines):
                if line.startswith("$ "):
                    rest = [x for _, x in lines[k + 1:]]
                    end = next((i for i, x in enumerate(rest) if x.startswith("$ ")), len(rest))
                    found.append(Command(name, n, line[2:].strip(), tuple(rest[:end])))
    return found


def not_run(command: Command) -> str | None:
    return next((why for start, why in NOT_RUN.items() if command.text.startswith(start)), None)


def with_budget(text: str) -> str:
    """A training command with :data:`BUDGET` appended (``make train``: inside its ``ARGS``)."""
    words = shlex.split(text, comments=True)
    if words[:2] == ["make", "train"]:
        args = [w.partition("=")[2] for w in words[2:] if w.startswith("ARGS=")]
        return shlex.join(["make", "-s", "-C", str(ROOT), "train", "ARGS=" + " ".join([*args, *BUDGET])])
    if words[:1] == ["meshtron"] and len(words) > 1 and words[1] in ("train", "launch") and "--print-config" not in words:
        redirect = text.find(" > ")
        head, tail = (text[:redirect], text[redirect:]) if redirect > 0 else (text.split(" #")[0], "")
        return f"{head} {' '.join(BUDGET)}{tail}"
    return text


# ---- what the pages assume a user already has -----------------------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 500000.0, "bos_token_id": 1,
         "eos_token_id": 2, "tie_word_embeddings": True}
MIXTRAL = {**LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": None, "tie_word_embeddings": False}
TEXT = ("The with statement wraps a block in a context manager. Lists hold items in order; a dict maps keys to "
        "values. def reverse(s): return s[::-1]\n")


def hugging_face_model(directory: Path, config: dict, tokenizer: Path) -> None:
    """A Hugging Face model directory in the real layout: config.json, model.safetensors, tokenizer.json."""
    from safetensors.numpy import save_file

    from meshtron.models.registry import hf_families, hf_mapping

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    mapping = next(hf_mapping(f) for f in hf_families() if config["architectures"][0] in hf_mapping(f).ARCHITECTURES)
    model = mapping.model_config(config, directory / "config.json")
    rng = np.random.default_rng(0)
    tensors = {}
    for spec in mapping.tensors(model):
        if spec.path == mapping.HEAD and mapping.head_tied(config):
            continue
        names = ([spec.hf.format(i=i, j=j) for i in range(model.layers) for j in range(model.moe.experts)]
                 if spec.per_expert else [spec.hf.format(i=i) for i in range(model.layers)] if spec.per_layer
                 else [spec.hf])
        for name in names:
            tensors[name] = rng.normal(0, 0.05, spec.hf_shape).astype(np.float32)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(tokenizer, directory / "tokenizer.json")


@pytest.fixture(scope="module")
def assumed(tmp_path_factory) -> Path:
    """Everything the pages assume, built once: copied into each page's directory."""
    from meshtron.data.tokenizers import train_bpe

    root = tmp_path_factory.mktemp("assumed")
    (root / "corpus").mkdir()
    (root / "code" / "lib").mkdir(parents=True)
    for k in range(3):
        (root / "corpus" / f"part{k}.txt").write_text(TEXT * (400 + k))
        with open(root / "corpus" / f"part{k}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": line}) + "\n" for line in (TEXT * 2000).splitlines())
        (root / "code" / "lib" / f"module{k}.py").write_text("def reverse(s):\n    return s[::-1]\n" * 2000)
    with open(root / "sft.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"reverse {word}", "response": word[::-1]}) + "\n" for word in ("abcd", "bdca", "mesh", "tron", "lamb", "pipe") * 5)
    tokenizer = train_bpe([root / "corpus" / "part0.txt"], 400, root / "tokenizer.json", min_frequency=1).path
    hugging_face_model(root / "home" / "models" / "Llama-3.2-1B", LLAMA, tokenizer)
    hugging_face_model(root / "home" / "models" / "Mixtral-8x7B-v0.1", MIXTRAL, tokenizer)
    shutil.copyfile(ROOT / "mesh_configs" / "paper" / "gpt_1_7b.yaml", root / "my_model.yaml")
    shutil.copyfile(ROOT / "src" / "meshtron" / "plan" / "clusters" / "h100-80gb.yaml", root / "my_cluster.yaml")
    for name in ("web", "code"):  # tokenised once here; a page that makes its own gets none (``_prepared``)
        subprocess.run([str(BIN / "meshtron"), "preprocess", "--input", "corpus/*.jsonl", "--tokenizer",
                        "tokenizer.json", "--output", f"prepared/{name}"], cwd=root, check=True, capture_output=True,
                       env=_environment(root))
    return root


def _prepared(page_dir: Path, assumed: Path, commands: list[Command]) -> None:
    """The page's directory: what every page assumes, and ``data/web`` / ``data/code`` (tokenised with the
    Hugging Face model's tokenizer) unless the page makes them."""
    shutil.copytree(assumed, page_dir, ignore=shutil.ignore_patterns("prepared"))
    made = " ".join(c.text for c in commands if "preprocess" in c.text)
    for name in ("web", "code"):
        if f"--output data/{name}" not in made:
            (page_dir / "data").mkdir(exist_ok=True)
            for file in (assumed / "prepared").glob(f"{name}.*"):
                shutil.copyfile(file, page_dir / "data" / file.name)


def _run_heavy(command: Command) -> bool:
    """A mixture of many experts' training (``model.moe.experts=64``): its steps' grouped expert GEMMs take
    longer at the tests' level than LLVM's first level spends more on compiling them, so it runs at that
    level (:data:`RUNNING`). ``mixtral_cpu8``'s 8 experts do not: with :data:`BUDGET`'s two steps of 64
    tokens its run (and a DeepSeek's on it) costs about 15% less CPU time at the tests' level."""
    words = command.text.split()
    return words[:2] == ["meshtron", "train"] and any(w.startswith("model.moe.experts=") for w in words)


def _environment(page_dir: Path, optimisation: str | None = None) -> dict[str, str]:
    env = subprocess_env() if optimisation is None else subprocess_env(optimisation=optimisation)
    env.update(HOME=str(page_dir / "home"), PATH=f"{BIN}{os.pathsep}/usr/bin{os.pathsep}/bin")
    env.pop("MESHTRON_TRACEBACK", None)
    return env


def _ran(command: Command, page_dir: Path) -> None:
    script = with_budget(command.text)
    env = _environment(page_dir, RUNNING if _run_heavy(command) else None)
    done = subprocess.run(["bash", "-c", script], check=False, cwd=page_dir, env=env, capture_output=True,
                          text=True, timeout=900)
    where = f"{command.page}:{command.line}: {command.text}"
    assert done.returncode == 0, f"{where}\nexit {done.returncode}\n{done.stderr[-3000:]}"
    printed = " ".join((done.stdout + done.stderr).split())
    for expected in command.output:
        if expected.strip() and "..." not in expected:
            assert " ".join(expected.split()) in printed, f"{where}: does not print {expected!r}"


RUN_PAGES = [p.relative_to(ROOT).as_posix() for p in PAGES
             if any(not_run(c) is None for c in page_commands(p))]


def test_every_command_is_run_or_said_why_not():
    commands = [c for page in PAGES for c in page_commands(page)]
    assert len(commands) > 40
    skipped = [c for c in commands if not_run(c)]
    assert {not_run(c) for c in skipped} <= set(NOT_RUN.values())
    assert all(c.text.split()[0] in ("meshtron", "make") for c in commands if not not_run(c)), [
        c.text for c in commands if not not_run(c) and c.text.split()[0] not in ("meshtron", "make")]


@pytest.mark.parametrize("page", RUN_PAGES)
def test_the_pages_commands_run_as_written(page, assumed, tmp_path):
    commands = page_commands(ROOT / page)
    page_dir = tmp_path / "work"
    _prepared(page_dir, assumed, commands)
    for command in commands:
        if not_run(command) is None:
            _ran(command, page_dir)
