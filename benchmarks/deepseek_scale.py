"""DeepSeek-V2-Lite and DeepSeek-V3 at their real sizes: ``meshtron describe``'s plan of each bundled
config, and each train step compiled for compile-only H100s, summed up in one table.

    .venv-py312/bin/python benchmarks/deepseek_scale.py                 # both configs, plan and H100 compile
    .venv-py312/bin/python benchmarks/deepseek_scale.py --skip-compile  # the plans only, in seconds
    .venv-py312/bin/python benchmarks/deepseek_scale.py --configs deepseek_v3 --overrides model.layers=...

Each ``describe`` runs as a child process, one at a time (a compile of V3 holds several GB), with the
configs of this checkout's ``mesh_configs/``; its whole output is kept in
``benchmarks/results/deepseek_scale/<config>[-h100].txt`` and the figures read from it (parameters in
all and active, the modelled and compiled memory per device, the all-to-all bytes, the estimated MFU)
go to ``benchmarks/results/deepseek_scale.json`` and are printed. A compile needs the Python 3.12
stack with the ``gpu-compile`` extra.

Next to describe's parameter count it prints the count of the architecture as DeepSeek builds it --
dense MLPs in the first ``first_k_dense_replace`` layers only, experts in the others, the multi-token
modules apart -- from the config's shapes alone, so a difference between the two is what the model
holds beyond DeepSeek's layers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from meshtron.config import load_config

RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = ("deepseek_v2_lite", "deepseek_v3")
PUBLISHED = {  # DeepSeek-AI's own figures (DeepSeek-V2 and DeepSeek-V3 technical reports, model cards)
    "deepseek_v2_lite": {"total": 15.7e9, "active": 2.4e9, "mtp": 0.0},
    "deepseek_v3": {"total": 671e9, "active": 37e9, "mtp": 14e9},
}


def architecture_count(cfg) -> dict[str, float]:
    """Parameters of DeepSeek's own layer structure for ``cfg.model``: the main model in all and per
    token, and the multi-token modules' own parameters (embedding and head shared, not counted)."""
    m, a, e = cfg.model, cfg.model.mla, cfg.model.moe
    h, n = m.hidden, m.heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    query = n * qk * h if a.q_lora_rank is None else h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * n * qk
    attention = (query + h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
                 + a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim) + n * a.v_head_dim * h)
    norms = 2 * h
    dense = 3 * h * m.mlp_dim
    expert = 3 * h * e.mlp_dim
    bias = e.experts if e.router == "sigmoid" else 0  # the selection bias, a V3's only
    routed_all = e.experts * expert
    routed_active = e.top_k * expert
    shared = e.shared_experts * expert + h * e.experts + bias
    k = m.first_k_dense_replace
    moe_layers = m.layers - k
    outside = 2 * m.vocab_size * h + h
    total = m.layers * (attention + norms) + k * dense + moe_layers * (routed_all + shared) + outside
    active = m.layers * (attention + norms) + k * dense + moe_layers * (routed_active + shared) + outside
    module = attention + norms + routed_all + shared + 2 * h * h + 3 * h  # block, eh_proj, enorm/hnorm/norm
    module_active = attention + norms + routed_active + shared + 2 * h * h + 3 * h
    return {"total": total, "active": active, "mtp": m.mtp.layers * module, "mtp_active": m.mtp.layers * module_active}


FIGURES = {  # label -> a pattern on describe's output; the first group is the figure
    "parameters": r"^parameters \(([\d,]+) in all",
    "active": r"in all, ([\d,]+) active per token",
    "per_device_parameters": r"^parameters \(.*?([\d.]+ [KMGT]?i?B) per device\)",
    "modelled_peak_gpu": r"^peak +([\d.]+ [KMGT]?i?B)",
    "compiled_parameters": r"^  parameters +([\d.]+ [KMGT]?i?B)$",
    "compiled_optimizer": r"^  optimizer state +([\d.]+ [KMGT]?i?B)",
    "compiled_temporaries": r"^  temporaries +([\d.]+ [KMGT]?i?B)",
    "compiled_peak": r"^  peak +([\d.]+ [KMGT]?i?B) \(arguments",
    "modelled_against_compiled": r"^  modelled \(XLA:GPU\).*\(([+-][\d.]+%) against",
    "compile_seconds": r"compiled in ([\d.]+) s from abstract arrays",
    "all_to_all_formula": r"(ragged all-to-all of the routed rows \(balanced routing\) [\d.]+ [KMGT]?i?B|all-to-all [\d.]+ "
                          r"[KMGT]?i?B) per device, layer and microbatch",
    "mfu": r"MFU[^\d]*([\d.]+%)",
}


def figures(text: str) -> dict[str, str | None]:
    found = {}
    for name, pattern in FIGURES.items():
        match = re.search(pattern, text, re.MULTILINE)
        found[name] = match.group(1) if match else None
    found["all_to_all_rows"] = [line.strip() for line in text.splitlines() if line.startswith("all-to-all")]
    found["estimate"] = [line.strip() for line in text.split("estimated step on the GPU program", 1)[-1].splitlines()[1:]
                         if line.startswith("  ")] if "estimated step on the GPU program" in text else []
    return found


def run_describe(config: str, overrides: list[str], target: str | None, out: Path) -> dict:
    command = [sys.executable, "-m", "meshtron.cli", "describe", "--config", f"mesh_configs/{config}.yaml",
               *(["--target", target] if target else []), *overrides]
    started = time.perf_counter()
    done = subprocess.run(["nice", *command], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          capture_output=True, text=True, check=False)
    out.write_text(done.stdout + ("\n--- stderr ---\n" + done.stderr[-4000:] if done.returncode else ""))
    result = {"command": " ".join(["meshtron", *command[3:]]), "returncode": done.returncode,
              "seconds": round(time.perf_counter() - started, 1), "output": str(out.relative_to(ROOT))}
    if done.returncode:
        result["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"
    return {**result, **figures(done.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--target", default="h100")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--overrides", nargs="*", default=[], help="section.key=value for every describe")
    args = parser.parse_args()
    folder = RESULTS / "deepseek_scale"
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for config in args.configs.split(","):
        cfg = load_config(ROOT / "mesh_configs" / f"{config}.yaml", args.overrides)
        entry = {"architecture": architecture_count(cfg), "published": PUBLISHED.get(config),
                 "plan": run_describe(config, args.overrides, None, folder / f"{config}.txt")}
        if not args.skip_compile:
            entry["compile"] = run_describe(config, args.overrides, args.target, folder / f"{config}-{args.target}.txt")
        results[config] = entry
        arch, plan = entry["architecture"], entry["plan"]
        print(f"\n{config}: describe counts {plan['parameters']} in all, {plan['active']} active per token")
        print(f"  DeepSeek's structure: {arch['total'] / 1e9:.2f}B in all, {arch['active'] / 1e9:.2f}B active, "
              f"+ multi-token modules {arch['mtp'] / 1e9:.2f}B ({arch['mtp_active'] / 1e9:.2f}B active)")
        if plan["parameters"]:
            held = int(plan["parameters"].replace(",", ""))
            print(f"  describe minus DeepSeek's structure with its modules: {(held - arch['total'] - arch['mtp']) / 1e9:.2f}B")
        for stage in ("plan", "compile"):
            if stage in entry:
                shown = {k: v for k, v in entry[stage].items() if v and k not in ("estimate", "all_to_all_rows")}
                print(f"  {stage}: {json.dumps(shown)}")
                for line in entry[stage].get("all_to_all_rows", []) + entry[stage].get("estimate", []):
                    print(f"    {line}")
    path = RESULTS / "deepseek_scale.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
