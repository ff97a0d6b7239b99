"""Installed users have the configs: bundled names for ``--config``, ``meshtron configs``,
``train --print-config``, and a wheel that trains from a directory that holds no checkout."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml
from subprocess_env import OPTIMISATION

from meshtron.bundled_configs import bundled
from meshtron.cli import main
from meshtron.config import ConfigError, load_config, to_dict
from meshtron.launch import devices_per_process

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "mesh_configs"
SHIPPED = sorted(p.relative_to(CONFIGS).with_suffix("").as_posix() for p in CONFIGS.rglob("*.yaml"))


def test_every_file_in_mesh_configs_is_bundled():
    assert sorted(bundled()) == SHIPPED
    assert {"cpu8", "gpu8", "paper/gpt_1t", "paper/gpt_1_7b"} <= set(SHIPPED)


@pytest.mark.parametrize(
    "name, file",
    [("cpu8", "cpu8.yaml"), ("cpu8.yaml", "cpu8.yaml"), ("gpu8", "gpu8.yaml"), ("paper/gpt_1t", "paper/gpt_1t.yaml"),
     ("paper/gpt_7_5b.yaml", "paper/gpt_7_5b.yaml"), ("mesh_configs/paper/gpt_1t.yaml", "paper/gpt_1t.yaml")],
)
def test_a_bundled_name_loads_the_shipped_file(name, file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no mesh_configs/ here: a README command works outside a checkout too
    assert load_config(name) == load_config(CONFIGS / file)


def test_an_existing_path_takes_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("cpu8").write_text("parallel:\n  data: 8\n  pipe: 1\n  tensor: 1\n")
    assert load_config("cpu8").mesh.data == 8
    assert load_config("cpu8.yaml").mesh.data == 2  # no such file here: the bundled one


@pytest.mark.parametrize("command", [["train"], ["describe"], ["launch", "--processes", "2"]])
def test_an_unknown_name_is_one_line_naming_config_and_the_choices(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--config", "cpu9", "train.steps=2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(
        "meshtron: error: --config: no such file or bundled config 'cpu9'; bundled: cpu8, deepseek_v2_lite, deepseek_v3, gpu8, llama2_7b, llama2_13b, llama2_70b, llama3_8b, llama_cpu8, "
    )
    assert lines[0].endswith("paper/gpt_529_6b; see 'meshtron configs'")
    assert all(name in lines[0] for name in SHIPPED)


def test_missing_path_is_the_same_error():
    with pytest.raises(ConfigError, match=r"^--config: no such file or bundled config '/no/such/dir/x.yaml'; bundled"):
        load_config("/no/such/dir/x.yaml")


def test_launch_children_resolve_the_name(capsys, tmp_path, monkeypatch):
    """``meshtron launch`` reads the name itself (devices per process) and passes ``--config=NAME`` on."""
    monkeypatch.chdir(tmp_path)
    assert devices_per_process("cpu8", [], 2) == 4
    assert devices_per_process("paper/gpt_1_7b", ["parallel.data=4"], 2) == 2
    assert main(["train", "--config=cpu8", "--print-config"]) == 0  # a child's argument form
    assert yaml.safe_load(capsys.readouterr().out)["parallel"]["tensor"] == 2


def test_configs_lists_every_bundled_config(capsys):
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_name = {line.split()[0]: line for line in lines}
    assert len(lines) == len(SHIPPED) and sorted(by_name) == SHIPPED
    assert lines[0].startswith("cpu8") and lines[-1].startswith("paper/gpt_1t")  # smallest mesh first
    assert "data 2 x pipe 2 x tensor 2 = 8 devices; GPT 842.5K params: 4 layers, hidden 128" in by_name["cpu8"]
    assert "data 6 x pipe 64 x tensor 8 = 3072 devices" in by_name["paper/gpt_1t"]
    for name, line in by_name.items():  # the paper's names are their sizes: gpt_1_7b is 1.7B parameters
        if name.startswith("paper/gpt_"):
            size = name.removeprefix("paper/gpt_").replace("_", ".").upper()
            size = size if "." in size else f"{size[:-1]}.0{size[-1]}"
            assert f"GPT {size} params" in line


def test_print_config_is_the_merged_validated_config(capsys, tmp_path):
    assert main(["train", "--print-config", "--config", "cpu8", "parallel.tensor=4", "train.steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = load_config(CONFIGS / "cpu8.yaml", ["parallel.tensor=4", "train.steps=7"])
    assert printed == to_dict(expected)
    assert "mesh" not in printed and "pipeline" not in printed
    sizes = {axis: printed["parallel"][axis] for axis in ("data", "pipe", "tensor", "context")}
    assert sizes == {"data": 2, "pipe": 2, "tensor": 4, "context": 1} and printed["train"]["steps"] == 7
    assert printed["model"]["hidden"] == 128 and printed["checkpoint"]["dir"] is None  # file, then defaults
    saved = tmp_path / "run.yaml"  # the output is a config file itself
    saved.write_text(yaml.safe_dump(printed))
    assert load_config(saved) == expected

    assert main(["train", "--print-config", "parallel.tensor=3"]) == 2  # validated: 4 heads over 3 shards
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("meshtron: error: model.heads: 4 heads cannot be split")


@pytest.mark.parametrize("argv", [["configs"], ["train", "--print-config", "--config", "paper/gpt_1t"]])
def test_configs_and_print_config_do_not_import_jax(argv):
    script = (
        "import sys; from meshtron.cli import main; status = main(sys.argv[1:]); "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')], 'JAX imported'; "
        "sys.exit(status)"
    )
    run = subprocess.run([sys.executable, "-c", script, *argv], check=False, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout


def _run(args, timeout=600, **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run([str(a) for a in args], check=False, capture_output=True, text=True, timeout=timeout,
                         **kwargs)
    assert run.returncode == 0, f"{args} failed ({run.returncode})\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"
    return run


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_wheel_trains_from_a_directory_without_a_checkout(tmp_path):
    # Built from a copy of the checkout: an in-place build would leave build/ (whose stale modules a later
    # wheel would pick up) in the repository, and concurrent builds would share it.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "runs", "checkpoints"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, source])
    [wheel] = dist.glob("meshtron-*.whl")

    members = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "meshtron").rglob("*.py")}
    assert modules <= members, f"not in the wheel (pyproject.toml's package list): {sorted(modules - members)}"
    assert not [m for m in members if "calibration" in m]  # the planner's CPU calibration is a benchmark harness
    assert {f"meshtron/mesh_configs/{name}.yaml" for name in SHIPPED} <= members
    assert {"meshtron/builtin_corpus.txt.gz", "meshtron/builtin_corpus.NOTICE.txt"} <= members  # the default data
    clusters = {f"meshtron/plan/clusters/{p.name}" for p in (ROOT / "src/meshtron/plan/clusters").glob("*.yaml")}
    assert clusters and clusters <= members  # meshtron plan --cluster a100-80gb

    # A fresh environment with the wheel alone; its dependencies (jax, ...) are the current environment's,
    # seen through a .pth line. That adds the directory only: its own .pth files (this checkout's editable
    # install) are not run, so meshtron can only come from the wheel.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", wheel])
    site_packages = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    outer = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    assert sysconfig.get_paths()["purelib"] in outer
    (site_packages / "zz_outer_environment.pth").write_text("\n".join(outer) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["XLA_FLAGS"] = OPTIMISATION  # the tests' compiler level (conftest.py), not their device count:
    env["JAX_PLATFORMS"] = "cpu"  # the CLI must ask for the 8 devices itself
    probe = "import meshtron, meshtron.bundled_configs as b; print(meshtron.__file__); print(b.find('cpu8'))"
    where = _run([python, "-c", probe], cwd=elsewhere, env=env).stdout.splitlines()
    assert all(Path(p).resolve().is_relative_to(site_packages.resolve()) for p in where), where

    listed = _run([venv / "bin" / "meshtron", "configs"], cwd=elsewhere, env=env).stdout
    assert sorted(line.split()[0] for line in listed.splitlines()) == SHIPPED

    run = _run([
        venv / "bin" / "meshtron", "train", "--config", "cpu8", "train.steps=2", "train.batch_size=8",
        "parallel.microbatches=2", "model.hidden=32", "model.mlp_dim=64", "model.seq_len=32", "train.eval_every=2",
        "train.eval_batches=1", "train.log_every=1",
    ], cwd=elsewhere, env=env)
    assert "mesh {'data': 2, 'pipe': 2, 'tensor': 2}" in run.stdout and "steps 2" in run.stdout
    assert "held-out loss" in run.stdout
