"""Activation memory per layer, compiled vs the activation-memory model (Korthikanti et al. 2022, Table 2).

For both families, {remat none, selective, full} x {tensor parallel, tensor + sequence parallel} x two
sequence lengths x t in {2, 4, 8}, compiles the gradient of the loss on a (1, 1, t) mesh at two depths
and takes the difference of XLA's per-device temporary memory (``memory_analysis``) per added layer:
what one layer keeps for its backward pass, without the embedding, head, loss and gradients that
every depth shares. Next to it: :func:`meshtron.megatron.layer_activation_bytes` (the paper's model
with meshtron's block constants) and the paper's own fp16 figure. Also the recompute FLOPs of
selective and full recomputation per layer (``cost_analysis``, over remat none).

    .venv/bin/python benchmarks/activation_memory.py
"""

from __future__ import annotations

import statistics
import time

import _common
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron import families, megatron
from meshtron.config import MeshConfig, ModelConfig
from meshtron.execution import Execution
from meshtron.hlo.summary import analyze
from meshtron.mesh import build_mesh
from meshtron.train.state import model_def_from_config

FAMILIES = {
    "gpt": {"family": "gpt", "hidden": 128, "heads": 8, "mlp_dim": 512},
    # grouped-query attention with key/value heads every t splits (t does not divide them: replicated
    # on every rank, and the compiler may then run their projections on the sequence slice instead)
    "llama": {"family": "llama", "hidden": 128, "heads": 16, "kv_heads": 8, "mlp_dim": 512},
}
SEQ_LENS = (128, 512)
TENSOR = (2, 4, 8)
REMATS = ("none", "selective", "full")
MICROBATCH = 4
DEPTHS = (2, 34)  # far apart: one layer's stash under full recomputation is small next to XLA's buffer-assignment noise


def compile_gradient(model: ModelConfig, tensor: int):
    """The compiled value-and-gradient of the loss on a (1, 1, tensor) mesh, from abstract inputs."""
    mesh = build_mesh(MeshConfig(1, 1, tensor))
    md = model_def_from_config(model, tensor)
    params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), md.shapes(),
                          md.shardings(mesh))
    tokens = jax.ShapeDtypeStruct((MICROBATCH, model.seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, P()))
    execution = Execution.of_model_config(model)
    loss = jax.value_and_grad(lambda p, t: md.loss(p, t, execution))
    with jax.set_mesh(mesh):
        return jax.jit(md.traced(loss, execution)).lower(params, tokens).compile()


def measure(family: str, seq_len: int, tensor: int, remat: str, sequence_parallel: bool) -> dict:
    shape = FAMILIES[family]
    temps, flops = [], []
    for layers in DEPTHS:
        model = ModelConfig(**shape, layers=layers, seq_len=seq_len, remat=remat, sequence_parallel=sequence_parallel)
        compiled = compile_gradient(model, tensor)
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
        flops.append(analyze(compiled, {"data": 1, "pipe": 1, "tensor": tensor}).flops)
    dims = {"seq_len": seq_len, "microbatch": MICROBATCH, "hidden": shape["hidden"], "heads": shape["heads"],
            "tensor": tensor, "sequence_parallel": sequence_parallel, "remat": remat}
    measured = (temps[1] - temps[0]) / (DEPTHS[1] - DEPTHS[0])
    predicted = megatron.layer_activation_bytes(**dims, kv_heads=shape.get("kv_heads"), mlp_dim=shape["mlp_dim"],
                                                block=families.FAMILIES[family].load_counts().BLOCK)
    return {
        "family": family, "seq_len": seq_len, "tensor": tensor, "remat": remat, "sequence_parallel": sequence_parallel,
        "measured_bytes": measured, "predicted_bytes": predicted, "ratio": measured / predicted,
        "paper_fp16_bytes": megatron.paper_layer_activation_bytes(**dims),
        "temp_bytes": temps, "flops": flops,
    }


def main() -> None:
    results = []
    started = time.perf_counter()
    for family in FAMILIES:
        for seq_len in SEQ_LENS:
            for tensor in TENSOR:
                for remat in REMATS:
                    for sp in (False, True):
                        results.append(measure(family, seq_len, tensor, remat, sp))
    by_key = {(r["family"], r["seq_len"], r["tensor"], r["remat"], r["sequence_parallel"]): r for r in results}
    rows, sp_ratios = [], []
    for r in results:
        sbh = r["seq_len"] * MICROBATCH * FAMILIES[r["family"]]["hidden"]
        sp_row = ""
        if r["sequence_parallel"]:
            base = by_key[(r["family"], r["seq_len"], r["tensor"], r["remat"], False)]
            measured_ratio = r["measured_bytes"] / base["measured_bytes"]
            predicted_ratio = r["predicted_bytes"] / base["predicted_bytes"]
            r["sp_ratio_measured"], r["sp_ratio_predicted"] = measured_ratio, predicted_ratio
            sp_ratios.append(measured_ratio / predicted_ratio)
            sp_row = f"{measured_ratio:.3f} / {predicted_ratio:.3f}"
        rows.append([
            r["family"], r["seq_len"], r["tensor"], r["remat"], "TP+SP" if r["sequence_parallel"] else "TP",
            f"{r['measured_bytes'] / 4 / sbh:.2f}", f"{r['predicted_bytes'] / 4 / sbh:.2f}", f"{r['ratio']:.3f}",
            f"{r['paper_fp16_bytes'] / 2 / sbh:.2f}", sp_row,
        ])
    print("per layer and device; sbh = seq_len*microbatch*hidden fp32 elements (paper: fp16 elements)")
    _common.print_table(["family", "s", "t", "remat", "layout", "measured sbh", "model sbh", "meas/model",
                         "paper sbh", "SP/TP meas / model"], rows)

    # XLA's cost analysis counts a loop body once, whatever its trip count (the FLOPs of both depths
    # are equal): the difference between remat modes at one depth is one layer's recomputation.
    recompute = []
    for family in FAMILIES:
        for seq_len in SEQ_LENS:
            for tensor in TENSOR:
                none, sel, full = (by_key[(family, seq_len, tensor, remat, False)]["flops"][0] for remat in REMATS)
                # A layer's forward + backward is about three forwards; full recomputation adds one forward.
                layer = 3 * (full - none)
                recompute.append({"family": family, "seq_len": seq_len, "tensor": tensor,
                                  "selective_extra_flops": sel - none, "full_extra_flops": full - none,
                                  "selective_over_full": (sel - none) / (full - none),
                                  "selective_overhead": (sel - none) / layer, "full_overhead": (full - none) / layer})
    print("\nrecompute FLOPs per layer and device (cost_analysis), over remat none; overhead against a layer's "
          "forward + backward (3 forwards)")
    _common.print_table(["family", "s", "t", "selective", "full", "selective +%", "full +%", "selective/full"], [
        [c["family"], c["seq_len"], c["tensor"], f"{c['selective_extra_flops']:.4g}", f"{c['full_extra_flops']:.4g}",
         f"{100 * c['selective_overhead']:.1f}", f"{100 * c['full_overhead']:.1f}", f"{c['selective_over_full']:.3f}"]
        for c in recompute])

    ratios = [r["ratio"] for r in results]
    summary = {
        "worst_measured_over_model": max(ratios, key=lambda x: abs(x - 1)),
        "median_measured_over_model": statistics.median(ratios),
        "worst_sp_ratio_over_model": max(sp_ratios, key=lambda x: abs(x - 1)),
        "median_selective_over_full_recompute": statistics.median(c["selective_over_full"] for c in recompute),
        "seconds": time.perf_counter() - started,
    }
    print(f"\nmeasured/model: median {summary['median_measured_over_model']:.3f}, worst "
          f"{summary['worst_measured_over_model']:.3f}; SP/TP ratio measured/model: worst "
          f"{summary['worst_sp_ratio_over_model']:.3f}; selective recompute FLOPs / full's: median "
          f"{summary['median_selective_over_full_recompute']:.3f} ({summary['seconds']:.0f} s)")
    path = _common.write_results("activation_memory", {
        "microbatch": MICROBATCH, "depths": DEPTHS, "families": FAMILIES, "summary": summary,
        "results": results, "recompute": recompute})
    plot(results)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    markers = {"none": "o", "selective": "s", "full": "^"}
    for r in results:
        color = "tab:orange" if r["sequence_parallel"] else "tab:blue"
        left.scatter(r["predicted_bytes"] / 2**20, r["measured_bytes"] / 2**20, marker=markers[r["remat"]],
                     color=color, facecolors="none" if r["family"] == "llama" else color, s=36)
    low = min(min(r["predicted_bytes"], r["measured_bytes"]) for r in results) / 2**20
    high = max(max(r["predicted_bytes"], r["measured_bytes"]) for r in results) / 2**20
    left.plot([low, high], [low, high], color="grey", lw=0.8)
    left.fill_between([low, high], [low * 0.85, high * 0.85], [low * 1.15, high * 1.15], color="grey", alpha=0.15)
    left.set(xscale="log", yscale="log", xlabel="model (MiB per layer)", ylabel="compiled (MiB per layer)",
             title="activation memory per layer and device (band: ±15%)")
    for remat, marker in markers.items():
        left.scatter([], [], marker=marker, color="black", label=f"remat {remat}")
    left.scatter([], [], color="tab:blue", label="TP")
    left.scatter([], [], color="tab:orange", label="TP+SP")
    left.legend(title="filled: GPT, open: Llama", fontsize=8)

    labels, measured, predicted = [], [], []
    for r in results:
        if r["sequence_parallel"] and r["family"] == "gpt":
            labels.append(f"{r['remat'][:4]} s{r['seq_len']} t{r['tensor']}")
            measured.append(r["sp_ratio_measured"])
            predicted.append(r["sp_ratio_predicted"])
    x = range(len(labels))
    right.bar([i - 0.2 for i in x], measured, width=0.4, label="compiled")
    right.bar([i + 0.2 for i in x], predicted, width=0.4, label="model")
    right.set_xticks(list(x), labels, rotation=75, fontsize=7)
    right.set(ylabel="TP+SP / TP", title="what sequence parallelism saves (GPT)")
    right.legend()
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "activation_memory.png", dpi=120)


if __name__ == "__main__":
    main()
