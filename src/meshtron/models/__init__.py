"""Models: the contract every model follows (:mod:`meshtron.models.contract`), the attention helper,
and the built-in families (``gpt``, ``llama``), which are reached by name (:mod:`meshtron.models.registry`)
exactly like a user's own model."""

from meshtron.models.contract import (
    RESIDUAL,
    WHOLE_SEQUENCE,
    Context,
    ModelContractError,
    ModelFactory,
    check_model,
    enter_parallel_region,
    exit_parallel_region,
    lm_loss,
    logits_of,
    run_blocks,
    stack_blocks,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "RESIDUAL", "WHOLE_SEQUENCE", "Context", "ModelContractError", "ModelFactory", "check_model",
    "enter_parallel_region", "exit_parallel_region", "lm_loss", "logits_of", "run_blocks", "stack_blocks",
    "vocab_parallel_cross_entropy",
]
