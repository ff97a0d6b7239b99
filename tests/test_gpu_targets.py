"""GPU targets: the shipped chip descriptions become compile-only devices of the right kind, bad
requests are one line, and ``meshtron describe --target`` prints the GPU program's figures."""

from __future__ import annotations

import pytest

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.errors import ConfigError
from meshtron.gpu.targets import MAX_DEVICES, TARGETS, devices_for_mesh, target, target_devices
from meshtron.plan.cluster import load_cluster

pytestmark = [pytest.mark.gpu_compile]
plugin = pytest.importorskip("jax_plugins.xla_cuda12",
                             reason="JAX's CUDA plugin (the gpu-compile extra) is not installed: make test-py312 installs it")


@pytest.mark.parametrize(("name", "kind", "memory_gb"), [
    ("h100", "NVIDIA H100 80GB HBM3", 80), ("h200", "NVIDIA H200 141GB HBM3e", 141), ("a100", "NVIDIA A100-SXM4-80GB", 80),
])
def test_each_target_is_its_chip_with_its_planner_cluster(name, kind, memory_gb):
    devices = target_devices(name, 16)
    assert [d.id for d in devices] == list(range(16))
    assert {d.platform for d in devices} == {"gpu"} and {d.device_kind for d in devices} == {kind}
    assert {d.process_index for d in devices} == {0}  # one process compiles for all of them
    cluster = load_cluster(TARGETS[name].cluster)
    assert cluster.memory_gb == memory_gb and cluster.gpus_per_node == 8


def test_a_bad_request_is_one_line_naming_the_fix():
    with pytest.raises(ConfigError, match=r"^--target h800: unknown|unknown GPU target 'h800'; use one of h100, h200, a100"):
        target("h800")
    with pytest.raises(ConfigError, match=rf"the mesh needs {MAX_DEVICES + 1} devices; compiling for a GPU target takes 1 "
                                          rf"to {MAX_DEVICES}"):
        target_devices("h100", MAX_DEVICES + 1)
    with pytest.raises(ConfigError, match=r"--target h100: the mesh must give every size \(parallel.data=-1,"):
        devices_for_mesh(load_config("cpu8", ["parallel.data=-1"]).mesh, "h100")


def test_cudnn_attention_is_refused_on_cpu_devices_and_accepted_for_a_gpu_target():
    from meshtron.train.state import model_def_from_config

    cfg = load_config("llama_cpu8", ["model.attention=cudnn", "model.dtype=bfloat16"]).model
    with pytest.raises(ConfigError, match=r"model.attention: cudnn \(flash attention\) needs GPUs, this run has cpu "
                                          r"devices; use model.attention=xla \(or compile for a GPU target"):
        model_def_from_config(cfg, 2, platform="cpu")
    assert model_def_from_config(cfg, 2, platform="gpu").layers == 4


@pytest.mark.slow
def test_describe_compiles_for_the_target_and_prints_the_gpu_programs_figures(capsys):
    assert main(["describe", "--target", "h100", "--config", "cpu8", "train.batch_size=8", "parallel.zero=1"]) == 0
    out = capsys.readouterr().out
    assert "devices; compiled for 8 NVIDIA H100 80GB HBM3 (compile-only" in out
    assert "XLA:GPU's buffer assignment" in out and "modelled (XLA:GPU)" in out
    collectives = out[out.index("collectives per mesh axis"):]
    assert "reduce-scatter      data" in collectives  # a real reduce-scatter, where XLA:CPU has all-reduce + slice


@pytest.mark.slow
def test_plan_prices_its_best_layout_from_the_compiled_gpu_program(tmp_path, capsys):
    import json

    out = tmp_path / "plan.json"
    assert main(["plan", "--config", "cpu8", "--gpus", "8", "--top", "2", "--target", "h100", "--compile-top", "1",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cluster   h100-80gb: 8 GPUs" in printed  # the target's cluster prices the ranking
    assert "the top 1 compiled for h100" in printed
    compiled = json.loads(out.read_text())["compiled"]
    assert compiled["target"] == "h100"
    [row] = compiled["layouts"]
    assert row["priced_by"] == "gpu program" and row["program_step_seconds"] > 0 and 0 < row["mfu"] < 1
    assert row["analytical_step_seconds"] == json.loads(out.read_text())["ranked"][0]["step_seconds"]
