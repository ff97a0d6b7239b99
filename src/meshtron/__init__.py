"""meshtron: Megatron-style data x pipeline x tensor parallel training for JAX/Flax."""

from meshtron.config import (
    Config,
    DataConfig,
    MeshConfig,
    ModelConfig,
    PipelineConfig,
    TrainConfig,
    load_config,
)
from meshtron.errors import ConfigError

# The training API imports JAX; it loads on first use so `meshtron configs` and config handling stay light.
_LAZY = {
    "Trainer": "meshtron.train.loop",
    "check_parity": "meshtron.testing",
    "load_pretrained": "meshtron.pretrained",
    "sample": "meshtron.generate",
}

__all__ = [
    "Config", "ConfigError", "DataConfig", "MeshConfig", "ModelConfig", "PipelineConfig", "TrainConfig", "Trainer",
    "check_parity", "load_config", "load_pretrained", "sample",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshtron' has no attribute {name!r}")
__version__ = "0.1.0"
