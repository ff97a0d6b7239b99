"""``meshtron train | describe``: the command line.

The config is read and validated *before* JAX is imported, so that on a CPU-only machine the CLI
can still ask XLA for as many simulated host devices as the mesh needs (appending to any
``XLA_FLAGS`` the user set, never replacing them). Bad input ends in one line naming the field
and the fix, with exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from meshtron.config import Config, ConfigError, load_config
from meshtron.mesh import devices_requested, ensure_cpu_devices

# Planning presets (the paper's 1T model) may ask for thousands of devices; only simulate small meshes.
MAX_SIMULATED_DEVICES = 64


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshtron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="YAML config (e.g. mesh_configs/cpu8.yaml)")
    common.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. mesh.tensor=4")
    train = sub.add_parser("train", parents=[common], help="train a GPT on the mesh")
    train.add_argument("--metrics", metavar="FILE.jsonl", help="write one JSON line per logged step")
    sub.add_parser("describe", parents=[common], help="mesh, parameter layout and the compiled step's collectives")
    return parser


def _load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config, args.overrides)
    needed = devices_requested(cfg.mesh)
    if needed <= MAX_SIMULATED_DEVICES:
        ensure_cpu_devices(needed)
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = _load(args)
        if args.command == "train":
            from meshtron.train.loop import train_from_config

            train_from_config(cfg, args.metrics)
        else:
            from meshtron.describe import describe

            describe(cfg)
    except ConfigError as err:
        print(f"meshtron: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshtron: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
