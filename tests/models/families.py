"""Small models of every family the parity tests run: GPT, Llama with grouped-query attention, and a
user's own model (:mod:`parallel_lm`)."""

from meshtron.config import ModelConfig
from meshtron.sharding import MEGATRON_RULES, extend_rules
from meshtron.train.state import ModelDef, model_def_from_config


def small(name: str, seq_len: int, tensor: int = 1, *, hidden: int = 32, heads: int = 4) -> ModelDef:
    """``name`` (gpt, llama or user) with 4 layers, a vocabulary of 64 and an MLP of 64."""
    if name == "user":
        import parallel_lm

        return ModelDef.create(lambda r: parallel_lm.ParallelLM(64, hidden, heads, 64, 4, seq_len, rngs=r),
                               rules=extend_rules(MEGATRON_RULES, parallel_lm.RULES))
    kv = {"kv_heads": 2} if name == "llama" else {}
    return model_def_from_config(ModelConfig(family=name, vocab_size=64, hidden=hidden, heads=heads, layers=4,
                                             mlp_dim=64, seq_len=seq_len, **kv), tensor)
