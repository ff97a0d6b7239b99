"""One meshtron train step compiled for GPUs without them: the scheduled HLO text saved for
``benchmarks/gpu_program_breakdown.py`` and the estimator's step, GEMM, memory-bound and exposed
seconds printed (``meshtron describe --compile --target`` prints the same estimate, not the program).

    python benchmarks/gpu_step_estimate.py --config llama2_7b --target h100 --hlo step.hlo.txt KEY=VALUE...

``--cpu-pullback`` traces a pipeline's per-layer pullback as for XLA:CPU (weight-gradient products
behind optimization barriers), as compile-only GPU programs were traced before the pullback followed
the mesh's platform (for comparing with figures measured then;
benchmarks/2026-12-01-gradient-accumulation-fusion.md).
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--target", default="h100")
    parser.add_argument("--hlo", required=True, help="where the compiled program's HLO text goes")
    parser.add_argument("--cpu-pullback", action="store_true",
                        help="trace the pipeline's per-layer pullback as for XLA:CPU (products behind barriers), as "
                             "compile-only GPU programs were traced before the pullback read the mesh's platform")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from meshtron.gpu.targets import prepare_environment

    prepare_environment()
    from meshtron import describe
    from meshtron.config import load_config
    from meshtron.train.loop import Trainer

    if args.cpu_pullback:
        from meshtron.pipeline import split_backward

        plain = split_backward.SplitPullback.__init__

        def as_on_cpu(self, *a, **k):
            plain(self, *a, **{**k, "contiguous_weight_matmuls": True, "weight_product_barrier": True})

        split_backward.SplitPullback.__init__ = as_on_cpu
    cfg = load_config(args.config, args.overrides)
    trainer = Trainer.from_config(cfg, target=args.target, read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    start = time.perf_counter()
    compiled = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0])
    seconds = time.perf_counter() - start
    hlo = Path(args.hlo)
    partial = hlo.with_name(hlo.name + ".partial")
    partial.write_text(compiled.as_text())
    partial.rename(hlo)
    count = trainer.mesh.devices.size
    model_def = describe.model_def_from_config(cfg.model, describe.resolve_sizes(cfg.mesh, count).tensor,
                                               platform="gpu")
    active = describe.active_parameters(model_def, cfg.model.moe.experts, cfg.model.moe.top_k)
    out = io.StringIO()
    describe.print_estimate(compiled, trainer.mesh, args.target, cfg, model_def, active, out, trainer.resolved)
    memory = compiled.memory_analysis()
    print(out.getvalue())
    print(json.dumps({"compile_seconds": round(seconds, 1),
                      "temp_gib": round(memory.temp_size_in_bytes / 2**30, 2),
                      "argument_gib": round(memory.argument_size_in_bytes / 2**30, 2)}))


if __name__ == "__main__":
    main()
