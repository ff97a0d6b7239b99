"""meshtron: Megatron-style data x pipeline x tensor parallel training for JAX/Flax."""

from meshtron.config import (
    Config,
    ConfigError,
    DataConfig,
    MeshConfig,
    ModelConfig,
    PipelineConfig,
    TrainConfig,
    load_config,
)

__all__ = [
    "Config", "ConfigError", "DataConfig", "MeshConfig", "ModelConfig", "PipelineConfig", "TrainConfig", "load_config",
]
__version__ = "0.1.0"
