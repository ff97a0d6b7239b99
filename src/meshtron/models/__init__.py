"""Models: the contract every model follows (:mod:`meshtron.models.contract`), the stacked blocks it is
built of and run by (:mod:`meshtron.models.blocks`), the attention helper, and the built-in families
(``gpt``, ``llama``), which are reached by name (:mod:`meshtron.models.registry`) exactly like a user's
own model.

The contract's names load on first use: the families' Hugging Face mappings (``*_hf.py``) and the
registry need no JAX, so ``meshtron configs`` stays light."""

__all__ = [
    "PREFIX_LAYERS", "RESIDUAL", "WHOLE_SEQUENCE", "Context", "ExtraLoss", "ModelContractError", "ModelFactory", "check_model",
    "embed_tokens", "enter_parallel_region", "exit_parallel_region", "lm_loss", "logits_of", "run_blocks", "stack_blocks",
    "vocab_parallel_cross_entropy",
]


def __getattr__(name: str):
    if name in __all__:
        from meshtron.models import blocks, contract

        return getattr(blocks if hasattr(blocks, name) else contract, name)
    raise AttributeError(f"module 'meshtron.models' has no attribute {name!r}")
