"""Where XLA:GPU lets a weight-gradient GEMM add into its layer's slot of a stacked float32 accumulator.

A pipeline stage accumulates ``[layers, in, out]`` float32 weight gradients over its microbatches, one
layer's slot at a time, and ZeRO-1 reduce-scatters them over ``data`` at the end of the step. Which
dimension that reduce-scatter splits decides the accumulator's layout in the whole loop (GPU layout
assignment propagates the collective's preferred layout backwards into the while loop), and the layout
decides whether the GEMM can write a slot in place (Megatron's ``main_grad``) or the slot is copied out
and back for every layer and microbatch.

This compiles, for 2 compile-only H100s (``meshtron.gpu.targets``), one toy program per variant -- the
split dimension, a barrier or a transpose before the collective, Triton or cuBLAS GEMMs -- and reads from
the optimized HLO: the accumulator's layout in the loop, whether a slot is copied out and written back
around the GEMM or the GEMM and the slot's update became one ``dynamic-slice-fusion``, and the
accumulator's transposes. Needs the
``gpu-compile`` extra (the second stack: ``.venv-py312``).

    .venv-py312/bin/python benchmarks/accumulator_layout.py      # about 10 s; results/accumulator_layout.{json,png}
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from meshtron.errors import ConfigError
from meshtron.gpu import targets
from meshtron.hlo.text import ArrayShape, parse_hlo_module

targets.prepare_environment()

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclass(frozen=True)
class Variant:
    name: str
    scatter_dim: int  # the accumulator's dimension the reduce-scatter over data splits
    before_scatter: str = "none"  # "barrier": optimization_barrier; "transpose": the split dimension moved first
    cublas: bool = False  # --xla_gpu_enable_triton_gemm=false


VARIANTS = [
    Variant("split 'in' (ZeRO-1 today), Triton", 1),
    Variant("split 'in', barrier before the scatter", 1, "barrier"),
    Variant("split 'in', transposed before the scatter", 1, "transpose"),
    Variant("split 'in', cuBLAS", 1, cublas=True),
    Variant("split 'layers', Triton", 0),
    Variant("split 'layers', cuBLAS", 0, cublas=True),
]


def step(variant: Variant, layers: int, microbatches: int):
    """Per device: for each microbatch, for each layer (a ``fori_loop`` whose counter is the slot index),
    ``acc[layer] += x[layer]ᵀ · g[layer]`` (bf16 operands, float32 product), then the reduce-scatter."""

    def local(acc, x, g):
        def microbatch(m, acc):
            def layer(i, acc):
                xs = jax.lax.dynamic_index_in_dim(x[m], i, keepdims=False)
                gs = jax.lax.dynamic_index_in_dim(g[m], i, keepdims=False)
                product = jax.lax.dot_general(xs, gs, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                slot = jax.lax.dynamic_index_in_dim(acc, i, keepdims=True)
                return jax.lax.dynamic_update_index_in_dim(acc, slot + product[None], i, 0)

            return jax.lax.fori_loop(0, layers, layer, acc)

        acc = jax.lax.fori_loop(0, microbatches, microbatch, acc)
        dim = variant.scatter_dim
        if variant.before_scatter == "barrier":
            acc = jax.lax.optimization_barrier(acc)
        elif variant.before_scatter == "transpose":
            acc = jnp.moveaxis(acc, dim, 0)
            dim = 0
        return jax.lax.psum_scatter(acc, "data", scatter_dimension=dim, tiled=True)

    return local


def compile_variant(variant: Variant, devices, layers: int, hidden: int, ffn: int, tokens: int,
                    microbatches: int) -> str:
    mesh = Mesh(devices, ("data",))
    out_spec = P("data") if variant.scatter_dim == 0 or variant.before_scatter == "transpose" else P(None, "data")
    fn = jax.shard_map(step(variant, layers, microbatches), mesh=mesh,
                       in_specs=(P(), P(None, None, "data"), P(None, None, "data")), out_specs=out_spec,
                       check_vma=False)
    acc = jax.ShapeDtypeStruct((layers, hidden, ffn), jnp.float32, sharding=NamedSharding(mesh, P()))
    per_token = NamedSharding(mesh, P(None, None, "data"))
    x = jax.ShapeDtypeStruct((microbatches, layers, tokens, hidden), jnp.bfloat16, sharding=per_token)
    g = jax.ShapeDtypeStruct((microbatches, layers, tokens, ffn), jnp.bfloat16, sharding=per_token)
    options = {"xla_gpu_enable_triton_gemm": False} if variant.cublas else None
    return jax.jit(fn, donate_argnums=0).lower(acc, x, g).compile(compiler_options=options).as_text()


def read(text: str, layers: int, hidden: int, ffn: int, microbatches: int) -> dict:
    """What the optimized HLO does with a layer's slot: copied out and written back around the GEMM, or
    added into in place by the GEMM (a ``dynamic-slice-fusion`` around cuBLAS's ``beta = 1`` matmul); and
    how often the accumulator (or the device's share of it) is transposed, into the collective's layout
    and back. A fused computation's root is its last instruction, as XLA prints them."""
    stacked = {(layers, hidden, ffn), (hidden, layers, ffn)}  # the stacked order, or 'in' outermost

    def dims(instruction) -> tuple[int, ...]:
        return instruction.shape.dims if isinstance(instruction.shape, ArrayShape) else ()

    def share(instruction) -> bool:  # the accumulator in either order, whole or one device's share
        d = dims(instruction)
        return len(d) == 3 and d[2] == ffn and layers in d[:2]

    kinds = {"in_place": 0, "copied_out": 0, "written_back": 0, "transposed": 0}
    for computation in parse_hlo_module(text).computations.values():
        if not computation.instructions:
            continue
        root = computation.instructions[-1]
        gemm = any(i.opcode == "dot" or (i.opcode == "custom-call" and "__cublas$" in i.attributes)
                   for i in computation.instructions)
        if gemm and any(i.opcode == "dynamic-update-slice" and dims(i) in stacked for i in computation.instructions):
            kinds["in_place"] += 1
        elif root.opcode == "dynamic-slice" and any(i.opcode == "parameter" and dims(i) == (layers, hidden, ffn)
                                                    for i in computation.instructions):
            kinds["copied_out"] += 1
        elif root.opcode == "dynamic-update-slice" and dims(root) in stacked:
            kinds["written_back"] += 1
        elif root.opcode == "transpose" and share(root):
            kinds["transposed"] += 1
    slot_bytes = 4 * hidden * ffn
    layouts = re.findall(rf"f32\[{layers},{hidden},{ffn}\]\{{([0-9,]+)\}}", text)  # the parser drops layouts
    return {
        "accumulator_layouts": sorted({"{" + layout + "}" for layout in layouts}),
        **kinds,
        "slot_bytes_copied_per_step": (kinds["copied_out"] + kinds["written_back"]) * slot_bytes * layers * microbatches,
        "gemm": "cuBLAS" if "__cublas$" in text else "Triton",
    }


def plot(rows: list[dict], path: Path) -> None:
    """Per variant: the slot bytes copied out and back a step, and the accumulator's transposes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (copied, turned) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    names = [row["name"] for row in rows]
    copied.barh(names, [row["slot_bytes_copied_per_step"] / 1e6 for row in rows], color="tab:red")
    copied.set_xlabel("slot MB copied out and back a step")
    turned.barh(names, [row["transposed"] for row in rows], color="tab:blue")
    turned.set_xlabel("transposes of the accumulator a step")
    copied.invert_yaxis()
    fig.suptitle("Stacked float32 gradient accumulator, 2 compile-only H100s: what the layout costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per microbatch, split over data")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--hlo-dir", type=Path, help="also write each variant's optimized HLO here")
    args = parser.parse_args()
    from _common import print_table, write_results

    try:
        devices = targets.target_devices("h100", 2)
    except ConfigError as err:  # no gpu-compile extra on this stack: one line saying what to install
        raise SystemExit(f"benchmarks/accumulator_layout.py: {err}") from None
    rows = []
    for variant in VARIANTS:
        text = compile_variant(variant, devices, args.layers, args.hidden, args.ffn, args.tokens, args.microbatches)
        if args.hlo_dir:
            args.hlo_dir.mkdir(parents=True, exist_ok=True)
            (args.hlo_dir / (re.sub(r"\W+", "_", variant.name).strip("_") + ".hlo.txt")).write_text(text)
        rows.append({**asdict(variant), **read(text, args.layers, args.hidden, args.ffn, args.microbatches)})
    print_table(["variant", "GEMM", "accumulator layouts", "in place", "slot out/back", "transposes", "slot MB copied"],
                [[row["name"], row["gemm"], " ".join(row["accumulator_layouts"]), "yes" if row["in_place"] else "no",
                  f"{row['copied_out']}/{row['written_back']}", row["transposed"],
                  f"{row['slot_bytes_copied_per_step'] / 1e6:.0f}"] for row in rows])
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "ffn", "tokens", "microbatches")}
    path = write_results("accumulator_layout", {"jax": jax.__version__, "target": "h100", "devices": 2,
                                                "shape": shape, "variants": rows})
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
