"""The command line as a user runs it: a short training run, describe, and bad input."""

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import subprocess_env

from meshtron.config import MeshConfig
from meshtron.generate import sample
from meshtron.pretrained import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.layers=4", "model.hidden=32", "model.mlp_dim=64", "model.seq_len=32", "train.batch_size=8"]


def meshtron(*args, timeout=300, xla_flags=None):
    env = subprocess_env(xla_flags or "")  # the CLI must add the device flag itself
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "meshtron.cli", *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_train_writes_metrics_and_a_summary(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run = meshtron(
        "train", "--config", "mesh_configs/cpu8.yaml", "--metrics", str(metrics), *SMALL,
        "train.steps=6", "train.log_every=2", "train.eval_every=3", "train.eval_batches=2",
        "train.optimizer=onebit_lamb", "optim.freeze_step=3",
        "parallel.data=4", "parallel.pipe=1", "parallel.chunks=1", "parallel.microbatches=2",  # quicker to compile
        f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=3",
    )
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[0] == {"step": 0, "event": "start", "weights": "a new model from seed 0"}
    records = records[1:]
    assert [r["step"] for r in records] == [2, 3, 4, 6]  # every log_every steps, and every evaluation
    assert set(records[0]) == {"step", "loss", "tokens_per_s", "step_seconds", "lr", "grad_norm", "stage",
                               "data_bytes", "model_flops_per_s"}
    assert all(r["step_seconds"] > 0 for r in records)
    assert set(records[1]) - set(records[0]) == {"heldout_loss", "heldout_loss_per_byte"}  # bytes: the same
    assert records[1]["heldout_loss"] == records[1]["heldout_loss_per_byte"] > 0
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in records)
    assert [r["stage"] for r in records] == ["warmup", "warmup", "compression", "compression"]
    assert records[0]["data_bytes"] > 20 * records[2]["data_bytes"] > 0  # a small model: padding and scales
    assert "held-out loss" in run.stdout and "unigram baseline" in run.stdout and "wall time" in run.stdout
    assert "sent over data" in run.stdout and "(warmup: 3 steps, compression: 3 steps)" in run.stdout
    assert "step 3: held-out loss" in run.stderr  # periodic evaluation, shown above the progress bar
    assert f"checkpoints       {tmp_path / 'ckpt'}: steps 3, 6" in run.stdout

    # The trained model samples the same text on another mesh (greedy), from the CLI and from Python.
    sampled = meshtron("generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "The ", "--max-tokens", "12",
                       "parallel.data=1", "parallel.tensor=2")
    assert sampled.returncode == 0, sampled.stderr
    assert "step 6 of" in sampled.stderr and "mesh 1x1x2" in sampled.stderr
    model = load_pretrained(tmp_path / "ckpt", MeshConfig(data=8, pipe=1, tensor=1))
    here = sample(model.model_def, model.params, model.mesh, "The ", max_new_tokens=12)
    assert sampled.stdout == here.text + "\n" and len(here.new_tokens) == 12
    # the checkpoint as a positional argument, the prompt as a chat message: the answer alone
    chat = meshtron("generate", str(tmp_path / "ckpt"), "--chat", "--prompt", "The ", "--max-tokens", "12",
                    "parallel.data=1", "parallel.tensor=2")
    assert chat.returncode == 0, chat.stderr
    from meshtron.data.sft import ChatTemplate

    answer = sample(model, ChatTemplate(model.tokenizer).prompt("The "), max_new_tokens=12)
    assert chat.stdout == answer.continuation + "\n"
    bad = meshtron("generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "x", "model.hidden=64")
    assert bad.returncode == 2 and "generate takes parallel.data=, parallel.pipe= or parallel.tensor= only" in bad.stderr


@pytest.mark.slow
def test_describe_prints_layout_and_compiled_collectives():
    run = meshtron("describe", "--config", "mesh_configs/cpu8.yaml", *SMALL)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "mesh      {'data': 2, 'pipe': 2, 'tensor': 2}" in out
    assert "wte" in out and "P('tensor', None)" in out and "(vocab, embed)" in out
    assert "P('pipe', None, 'tensor')" in out  # fc1 kernels: layers over pipe, mlp over tensor
    assert "compiled train step" in out and "all-reduce          tensor" in out and "all-reduce          data" in out
    assert "collective-permute  pipe" in out


# The process's own peak resident memory: VmHWM of its address space (ru_maxrss would also count the
# parent's, which Linux carries over fork and exec).
PEAK = ("import sys\nfrom meshtron.cli import main\nstatus = main(sys.argv[1:])\n"
        "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
        "print('peak KiB', hwm.split()[1])\nsys.exit(status)")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["paper/gpt_1_7b", "paper/gpt_3_6b", "llama2_7b"])
def test_describe_plans_a_real_model_on_a_mesh_this_machine_simulates_without_building_it(config):
    """32 and 64 devices are simulated here, but the models (1.7B, 3.6B and Llama-2's 6.7B parameters with
    their optimizer state) would not fit: describe prices them and builds nothing, in under 2 GB."""
    env = subprocess_env()
    run = subprocess.run([sys.executable, "-c", PEAK, "describe", "--config", config], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    peak = int(run.stdout.rsplit("peak KiB ", 1)[1])
    assert peak < 2 * 1024 * 1024, f"{config}: peak {peak / 1024:.0f} MiB"
    assert "this machine has" in run.stdout and "CPU devices)" in run.stdout  # the mesh was simulated
    assert "memory per device, this run as configured" in run.stdout and "planning mode: nothing is built" in run.stdout
    if config.startswith("paper/"):
        assert "plan on a100-80gb" in run.stdout and "memory per GPU" in run.stdout


@pytest.mark.slow
# CI compiles 70B (a pipeline and zero=3 at once); make test 7B on data x tensor too
@pytest.mark.parametrize("config, overrides", [
    pytest.param("llama2_7b", ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=8"], marks=pytest.mark.extended),
    ("llama2_70b", [])])
def test_describe_compile_compiles_a_real_model_for_its_mesh_without_allocating_it(config, overrides):
    """Llama-2 7B on 8x1x8 (64 devices) and 70B on 2x4x8 with zero=3: the real step compiled from
    abstract arrays, its memory per device printed, in well under the memory of one device's state."""
    env = subprocess_env()
    run = subprocess.run([sys.executable, "-c", PEAK, "describe", "--config", config, "--compile", *overrides],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.rsplit("peak KiB ", 1)[1]) < 2 * 1024 * 1024
    out = run.stdout
    assert "compiled train step: memory per device (compiled in" in out and "planning mode" not in out
    for label in ("parameters", "optimizer state", "temporaries", "peak"):
        assert re.search(rf"^  {label} +\d", out, re.MULTILINE), label
    assert re.search(r"^reduce-scatter +data", out, re.MULTILINE) or config == "llama2_7b"  # 70B: zero=3
    # The step memory model (tests/test_step_memory.py) next to it, within 10% of the compiled peak.
    error = float(re.search(r"^  modelled \(XLA:CPU\) .*\(([-+][\d.]+)% against the compiled peak\)", out, re.MULTILINE)[1])
    assert abs(error) <= 10, out


def test_describe_compile_needs_the_mesh_simulated(capsys):
    from meshtron.cli import main

    assert main(["describe", "--config", "paper/gpt_1t", "--compile"]) == 2
    assert capsys.readouterr().err.startswith("meshtron: error: --compile: the mesh needs 3072 devices and this "
                                              "process has 8; the CLI simulates up to 64 CPU devices")


@pytest.mark.slow
def test_describe_decides_from_memory_and_needs_no_data(tmp_path):
    from meshtron.config import load_config
    from meshtron.describe import describe

    short = tmp_path / "short.txt"
    short.write_text("far fewer tokens than one batch\n")
    cfg = load_config("cpu8", [*SMALL, f"data.path={short}"])
    out = io.StringIO()
    describe(cfg, out=out)
    assert "compiled train step" in out.getvalue()  # the data is never read
    out = io.StringIO()
    describe(cfg, out=out, memory_budget=1e6)
    assert "more than the 976.6 KiB this machine can give (planning mode: nothing is built" in out.getvalue()


def test_planning_presets_describe_without_devices():
    run = meshtron("describe", "--config", "mesh_configs/paper/gpt_1t.yaml")
    assert run.returncode == 0, run.stderr
    assert "1,008,038,758,400" in run.stdout and "planning mode" in run.stdout
    assert "activation memory per device" in run.stdout and "stashed stage inputs" in run.stdout


def test_bad_input_is_one_line_not_a_traceback(tmp_path):
    # The user fixed the device count, so the CLI may not raise it: the mesh does not fit.
    run = meshtron(
        "train", "--config", "mesh_configs/cpu8.yaml", "parallel.data=4", "parallel.tensor=4",
        xla_flags="--xla_force_host_platform_device_count=8",
    )
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "meshtron: error: parallel: data x pipe x tensor = 4 x 2 x 4 = 32 devices, but this run has 8; "
        "shrink the mesh (e.g. parallel.data) or add devices (on a CPU, simulate them: "
        "XLA_FLAGS=--xla_force_host_platform_device_count=32 before JAX starts)"
    )
    missing = meshtron("train", "--config", "mesh_configs/cpu8.yaml", "data.path=/nope.txt")
    assert missing.returncode == 2 and "data.path" in missing.stderr and "Traceback" not in missing.stderr


def test_schedule_prints_the_table_its_report_and_draws_it(tmp_path):
    png = tmp_path / "zb.png"
    run = meshtron("schedule", "zb-h1", "--pipe", "2", "--microbatches", "4", "--png", str(png))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[1].split() == ["stage", "0:", "F0", "F1", ".", "B0", "W0", "F2", "B1", "W1", "F3", "B2", "W2", "B3",
                                "W3"]
    assert "bubble               0.0833" in run.stdout and "textbook 0.0833" in run.stdout  # (p-1)/(3m)
    assert "in flight per stage  2, 1" in run.stdout and "W pending per stage  1, 2" in run.stdout
    assert "until W per stage    2, 2" in run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = [meshtron("schedule", "zb-h1", "--pipe", "4", "--microbatches", "2"),
           meshtron("schedule", "1f1b", "--pipe", "2", "--microbatches", "4", "--costs", "1,x")]
    assert [r.returncode for r in bad] == [2, 2] and all("Traceback" not in r.stderr for r in bad)
    assert bad[0].stderr.strip() == "meshtron: error: microbatches: m=2 < p=4: the pipeline cannot fill; use at least 4"
    assert "--costs" in bad[1].stderr


def test_schedule_prices_a_recomputation_hoisted_into_the_forward_tick(tmp_path):
    # t_R, the fourth cost: 1f1b-p reruns each backward's stage forward in the forward tick before it.
    png = tmp_path / "p.png"
    run = meshtron("schedule", "1f1b-p", "--pipe", "4", "--microbatches", "8", "--costs", "1,1,1,1", "--png", str(png))
    assert run.returncode == 0, run.stderr
    assert "bubble               0.2812 of the ideal time (t_F=1, t_B=1, t_W=1, t_R=1)" in run.stdout  # 3(p-1)/(4m)
    assert "in flight per stage  4, 3, 2, 1" in run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_reads_and_writes_pytorch_action_csvs(tmp_path):
    torch_csv = ROOT / "tests" / "fixtures" / "torch_schedules" / "interleavedzerobubble_p2_m4_v2.csv"
    out = tmp_path / "out.csv"
    run = meshtron("schedule", str(torch_csv), "--png", str(tmp_path / "t.png"), "--csv", str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("interleavedzerobubble_p2_m4_v2.csv: p=2 stages, m=4 microbatches, v=2 chunks")
    assert "no textbook value" in run.stdout
    assert out.read_text().splitlines()[1].startswith(",1F0,1F1,3F0,3I0,3F1,3I1,3W0")  # torch's rank 1, as torch wrote it
    bad = [meshtron("schedule", "zb-h1", "--microbatches", "4"),
           meshtron("schedule", str(torch_csv.with_name("zbv_p2_m4.csv")))]
    assert [r.returncode for r in bad] == [2, 2] and all("Traceback" not in r.stderr for r in bad)
    assert bad[0].stderr.strip() == "meshtron: error: --pipe: required for the built-in schedule 'zb-h1'"
    assert "this is a V placement" in bad[1].stderr


@pytest.mark.parametrize("argv, message", [
    (["train", "--config", "cpu8", "model.factory=os.path:join"],
     ("model: the model factory os.path:join raised TypeError while building the model: expected str, bytes or "
     "os.PathLike object, not ModelConfig")),
    (["train", "--config", "cpu8", "train.tensorboard={file}"],
     "train.tensorboard: '{file}' is a file; give a directory (it is created if missing)"),
    (["train", "--config", "cpu8", "--tensorboard", "{file}/tb"], ("--tensorboard: '{file}/tb' cannot be created: {file} "
                                                                 "is a file")),
    (["train", "--config", "cpu8", "train.profile_steps=2:3", "train.profile_dir={file}"],
     "train.profile_dir: '{file}' is a file; give a directory"),
    (["train", "--config", "cpu8", "--metrics", "{dir}"], "--metrics: '{dir}' is a directory; give a file's path"),
    (["train", "--config", "cpu8", "checkpoint.dir={file}"], "checkpoint.dir: '{file}' is a file; give a directory"),
    (["tokenizer", "train", "--input", "{file}", "--vocab-size", "300", "--output", "{dir}"],
     "--output: '{dir}' is a directory; give a file's path"),
    (["preprocess", "--input", "{file}", "--tokenizer", "bytes", "--output", "{file}/data"],
     "--output: '{file}/data' cannot be created: {file} is a file"),
    (["plot", "{file}", "--output", "{dir}"], "--output: '{dir}' is a directory; give a file's path"),
    (["export-hf", "{dir}", "--output", "{file}"], "--output: '{file}' is a file; give a directory"),
    (["schedule", "1f1b", "--pipe", "2", "--microbatches", "2", "--csv", "{dir}"],
     "--csv: '{dir}' is a directory; give a file's path"),
], ids=["factory-not-a-builder", "tensorboard-file", "tensorboard-under-file", "profile-dir", "metrics-dir",
        "checkpoint-file", "tokenizer-output", "preprocess-output", "plot-output", "export-output", "schedule-csv"])
def test_a_path_or_factory_that_cannot_work_is_one_line_before_anything_runs(argv, message, tmp_path, capsys):
    from meshtron.cli import main

    file = tmp_path / "a-file.txt"
    file.write_text("not a directory\n")
    fill = {"file": str(file), "dir": str(tmp_path)}
    assert main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"meshtron: error: {message.format(**fill)}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file.txt"]  # nothing was written


def test_overrides_stand_anywhere_and_generate_takes_its_checkpoint_either_way():
    from meshtron.cli import _generation_checkpoint, _parse

    imported = _parse(["import-hf", "hf", "--output", "runs/x", "model.seq_len=2048"])
    assert imported.overrides == ["model.seq_len=2048"] and imported.output == "runs/x"
    trained = _parse(["train", "parallel.data=2", "--config", "cpu8", "--metrics", "m.jsonl", "train.steps=3"])
    assert trained.overrides == ["parallel.data=2", "train.steps=3"] and trained.metrics == "m.jsonl"
    for argv in (["generate", "runs/a", "--prompt", "hi", "parallel.tensor=4"],
                 ["generate", "--checkpoint", "runs/a", "--prompt", "hi", "parallel.tensor=4"],
                 ["generate", "parallel.tensor=4", "--prompt", "hi", "--checkpoint", "runs/a"]):
        args = _parse(argv)
        _generation_checkpoint(args)
        assert (args.checkpoint, args.overrides) == ("runs/a", ["parallel.tensor=4"]), argv


def test_a_word_that_is_no_setting_is_refused_naming_it(capsys):
    from meshtron.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["export-hf", "runs/a", "--output", "out", "model.seq_len=8"])
    assert caught.value.code == 2
    assert "unrecognized arguments: model.seq_len=8 (export-hf takes no section.key=value settings)" in (
        capsys.readouterr().err)
    assert main(["generate", "--prompt", "x"]) == 2
    assert "generate: give the checkpoint once, as meshtron generate CKPT --prompt TEXT" in capsys.readouterr().err


def test_an_old_key_on_the_command_line_is_one_deprecation_line_per_command(capsys):
    """Old spellings (mesh.*, pipeline.*, train.microbatches, ...) still work, with one note on stderr, also
    where a command reads its config twice (plan) or mixes meshtron's own settings with the user's."""
    from meshtron.cli import main

    assert main(["train", "--print-config", "--config", "cpu8", "mesh.tensor=1", "train.zero=1"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "meshtron: mesh.tensor, train.zero are deprecated; write parallel.tensor, parallel.zero\n"
    assert "parallel:\n  data: 2\n  pipe: 2\n  tensor: 1\n" in captured.out and "mesh:" not in captured.out
    assert main(["plan", "--config", "paper/gpt_76_1b", "--gpus", "1024", "--top", "1", "mesh.context=1"]) == 0
    assert capsys.readouterr().err == "meshtron: mesh.context is deprecated; write parallel.context\n"
    assert main(["train", "--print-config", "--config", "cpu8", "mesh.data=2", "parallel.data=1"]) == 2
    assert capsys.readouterr().err == ("meshtron: error: mesh.data and parallel.data (command line): both set, to 2 "
                                       "and 1; mesh.data is the old name of parallel.data: write only parallel.data\n")
