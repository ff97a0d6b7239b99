"""``benchmarks/gpu_check.py``, the check made for a short loan of one GPU, run on the CPU at tiny sizes:
the same phases (one process each), the cuDNN -> XLA fallback, and the JSON it leaves under ``$OUT``.
No timing is asserted; the figures are checked against the formula they claim."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))  # the harness is not in the package

import gpu_check


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    env = subprocess_env() | {"OUT": str(out)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--steps", "2", "--warmup", "1", "--scale", "tiny"],
                         check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return run, out


@pytest.mark.slow
def test_the_cpu_mode_writes_every_phase_under_out(check):
    run, out = check
    assert run.returncode == 0, run.stdout + run.stderr
    payload = json.loads((out / "gpu_check.json").read_text())
    assert payload["cpu_mode"] and payload["scale"] == "tiny" and payload["peak_flops"] == 989e12
    assert set(payload["phases"]) == {"default", "llama_1b"}
    assert {p.name for p in out.iterdir()} == {"gpu_check.json", "gpu_check_default.json", "gpu_check_llama_1b.json"}
    for phase in payload["phases"].values():
        assert "error" not in phase, phase
        assert phase["device"]["platform"] == "cpu" and phase["device"]["jax"]
        assert len(phase["step_times_s"]) == 2 and len(phase["losses"]) == 3
        m = phase
        per_token = 6 * m["params"] + 12 * m["layers"] * m["hidden"] * m["seq_len"]
        assert m["tokens_per_step"] == m["batch_size"] * m["seq_len"]
        assert m["model_flops_per_step"] == pytest.approx(per_token * m["tokens_per_step"])
        median = statistics.median(m["step_times_s"])
        assert m["median_step_s"] == pytest.approx(median)
        assert m["tokens_per_s"] == pytest.approx(m["tokens_per_step"] / median)
        assert m["mfu"] == pytest.approx(m["model_flops_per_step"] / (median * 989e12))
        mem = m["compiled_memory"]
        assert mem["total_bytes"] == (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"]
                                      - mem["alias_size_in_bytes"] + mem["temp_size_in_bytes"])
        assert mem["argument_size_in_bytes"] >= 4 * m["params"]  # fp32 parameters at least
        assert "available" in m["estimate"]
    assert payload["phases"]["default"]["attention"] == "xla"
    llama = payload["phases"]["llama_1b"]
    assert llama["family"] == "llama" and llama["dtype"] == "bfloat16"
    # cuDNN needs a GPU: the phase falls back to XLA's attention and says so
    assert llama["attention"] == "xla"
    assert any("model.attention=cudnn" in note and "using model.attention=xla" in note for note in llama["notes"])
    assert "phase" in run.stdout and "MFU" in run.stdout and "wrote" in run.stdout


def test_the_bundled_1b_config_has_tinyllamas_shapes():
    from meshtron.config import load_config

    cfg = load_config(ROOT / "mesh_configs" / "tinyllama_1b.yaml", gpu_check.PHASE_CONFIGS["full"]["llama_1b"][1])
    m = cfg.model
    assert (m.family, m.hidden, m.layers, m.heads, m.kv_heads, m.mlp_dim, m.vocab_size, m.seq_len) == (
        "llama", 2048, 22, 32, 4, 5632, 32000, 2048)
    assert (m.dtype, m.attention) == ("bfloat16", "cudnn")
    assert (cfg.mesh.data, cfg.mesh.pipe, cfg.mesh.tensor, cfg.train.batch_size) == (1, 1, 1, 16)


def test_a_missing_package_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(gpu_check.NEEDED, "no_such_module_for_gpu_check", "no-such-dist")
    assert gpu_check.main(["--cpu"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no-such-dist" in err[0] and err[0].startswith("gpu_check: needs")
